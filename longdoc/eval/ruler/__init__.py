"""A RULER-style long-context suite (Hsieh et al. 2024), offline and deterministic: `longdoc eval ruler`.

    longdoc eval ruler --model SmolLM2-135M-Instruct --lengths 2k,4k,8k --samples 100 --cp 2
    longdoc eval ruler --model runs/demo/final --ruler-tasks niah_single,vt,qa --lengths 4k
    longdoc eval compare BASE TUNED --tasks ruler --lengths 2k,4k,8k       # paired intervals per task

Eight tasks (generate.TASKS): needle single / multi-key / multi-value / multi-query, variable tracking,
common-word and frequent-word extraction, QA over documents with distractors. Haystacks are a generated
traveller's prose (a template family of its own, never the training generator's) or RULER's repeated
noise (--ruler-haystack). Samples are pure functions of (task, length, index, seed), scored by RULER's
string match. docs/ruler.md documents each task and where it differs from RULER.

    words.py     vocabularies: needle keys, list words, made-up names and coded words
    prose.py     filler prose, RULER's noise, encyclopedia entries for QA
    build.py     token-exact prompts: the task frame (chat template) around pieces counted in tokens
    generate.py  the eight task generators
    run.py       the eval task (check / task / write_report): batched CP prefill + sharded-KV greedy
                 decoding, scoring, the score grid
    report.py    the run folder: results.json, summary.md, ruler.png

Nothing is imported here, so the command line can read the task names without loading torch.
"""
