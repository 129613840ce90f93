"""The RULER-style suite's samples (exact lengths, answers that follow from the prompt, determinism), its scoring,
its separation from the training generator, and `longdoc eval ruler` / `eval compare --tasks ruler` end to end."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from longdoc.eval.ruler import prose
from longdoc.eval.ruler.build import Builder
from longdoc.eval.ruler.generate import TASKS, make
from longdoc.eval.ruler.run import score


@pytest.fixture(scope="module")
def tok():
    from longdoc.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def builder(tok):
    return Builder(tok)


def _make(builder, task, length=1536, index=0, seed=0, haystack="prose"):
    return make(task, length, index, seed=seed, haystack=haystack, builder=builder)


@pytest.mark.parametrize("length", [1024, 3000])
@pytest.mark.parametrize("haystack", ["prose", "noise"])
def test_every_prompt_has_exactly_the_length_minus_the_answer_budget(builder, length, haystack):
    for task, spec in TASKS.items():
        for i in range(2):
            s = _make(builder, task, length, i, haystack=haystack)
            assert len(s.ids) == length - spec.max_new_tokens, task


def test_samples_are_deterministic_and_differ_by_index_and_seed(builder):
    for task in TASKS:
        a, b = _make(builder, task), _make(builder, task)
        assert a.ids == b.ids and a.references == b.references
        assert _make(builder, task, index=1).ids != a.ids
        assert _make(builder, task, seed=1).ids != a.ids


def _context(tok, s) -> str:
    return tok.decode(s.ids)


def test_needle_answers_are_in_the_prompt_and_distractors_are_not_expected(builder, tok):
    for task, keys, values in (("niah_single", 1, 1), ("niah_multikey", 4, 1), ("niah_multivalue", 1, 4),
                               ("niah_multiquery", 4, 4)):
        for i in range(3):
            s = _make(builder, task, index=i)
            text = _context(tok, s)
            needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
            assert len(needles) == max(keys, values), task
            asked = [k for k, _ in needles if k in s.query]
            assert sorted(s.references) == sorted(v for k, v in needles if k in asked), task
            assert len(s.references) == values and len(s.depths) == values
            assert f"magic numbers for {s.query} mentioned" in text


def test_needle_depths_spread_over_the_context(builder):
    depths = [_make(builder, "niah_single", index=i).depths[0] for i in range(24)]
    assert min(depths) < 0.2 and max(depths) > 0.8 and all(0 <= d <= 1 for d in depths)


def test_variable_chain_is_in_order_and_complete(builder, tok):
    s = _make(builder, "vt", index=3)
    text = _context(tok, s).split("Memorize and track")[-1]  # past the solved example
    names = s.references
    assert f"VAR {names[0]} = {s.query}." in text
    for prev, name in zip(names, names[1:]):
        assert f"VAR {name} = VAR {prev}." in text
    assert s.depths == sorted(s.depths) and len(set(s.depths)) == 5


def test_common_words_are_the_most_common_in_the_list(builder, tok):
    for i in range(3):
        s = _make(builder, "cwe", 3000, i)
        listing = _context(tok, s).split("Memorize the ones that appear most often.")[-1].split("Question:")[0]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", listing))
        top = [w for w, _ in counts.most_common(10)]
        assert sorted(top) == sorted(s.references)
        assert counts[s.references[-1]] > counts.most_common(11)[-1][1] + 1


def test_frequent_words_are_the_top_three(builder, tok):
    for i in range(3):
        s = _make(builder, "fwe", 3000, i)
        body = _context(tok, s).split("three most frequently appeared coded words.")[-1].split("Question:")[0]
        counts = Counter(body.split())
        assert sorted(w for w, _ in counts.most_common(3)) == sorted(s.references)


def test_qa_answer_is_stated_once_among_distractors(builder, tok):
    for i in range(4):
        s = _make(builder, "qa", 3000, i)
        text = _context(tok, s)
        docs = re.split(r"Document \d+:\n", text.split("The following are given documents.")[1])[1:-1]  # whole ones
        gold = [d for d in docs if d.split("\n")[0] in s.query]  # the entry whose title the question names
        assert len(gold) == 1 and s.references[0] in gold[0], s.query
        assert len(docs) > 5 and len({d.split("\n")[0] for d in docs}) == len(docs)  # distinct distractors


def test_score_is_rulers_string_match():
    assert score("The number is 1234567.", ["1234567"], "all") == 1.0
    assert score("1234567 and 7654321", ["1234567", "7654321", "1111111"], "all") == pytest.approx(2 / 3)
    assert score("AMBER lantern", ["amber"], "all") == 1.0  # case-insensitive
    assert score("nothing", ["1858", "Braimond"], "part") == 0.0
    assert score("It was Braimond.", ["1858", "braimond"], "part") == 1.0


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_no_training_text_in_the_suite(builder, tok):
    """The haystacks and QA entries share no 8-word sequence with the training generator's documents."""
    from longdoc.corpus.synth import synthesize

    training = " ".join(r["document"] for domain in ("legal", "medical") for seed in (0, 1)
                        for r in synthesize(domain, num_docs=1, tokens=4096, seed=seed, tokenizer=tok))
    suite = " ".join(_context(tok, _make(builder, t, 3000, i)) for t in ("niah_single", "qa") for i in range(3))
    shared = _shingles(training) & _shingles(suite)
    assert not shared, sorted(shared)[:5]
    assert "special magic" not in training and "grass is green" not in training


def test_prose_generator_is_deterministic():
    import random

    a = [s for s, _ in zip(prose.sentences(random.Random(3)), range(50))]
    b = [s for s, _ in zip(prose.sentences(random.Random(3)), range(50))]
    assert a == b and len(set(a)) > 40 and any(s.startswith("\n\n") for s in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from longdoc.cli import main

    root = tmp_path_factory.mktemp("ruler")
    common = ["--model", "tiny:llama", "--threads", "1", "--lengths", "1024", "--samples", "2",
              "--ruler-tasks", "niah_single,qa"]
    assert main(["eval", "ruler", *common, "--out", str(root / "a" / "ruler")]) == 0
    assert main(["eval", "ruler", *common, "--seed", "1", "--out", str(root / "b" / "ruler")]) == 0
    return root


def test_ruler_run_folder(runs):
    from longdoc.eval import report

    res = report.load_results(runs / "a" / "ruler")
    assert res["tasks"] == ["niah_single", "qa"] and res["lengths"] == [1024] and res["samples"] == 2
    assert len(res["rows"]) == 4 and [len(r) for r in res["grid"]] == [1, 1] and len(res["average"]) == 1
    assert {r["prompt_tokens"] for r in res["rows"]} == {1024 - 16}
    assert (runs / "a" / "ruler" / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| niah_single |" in (runs / "a" / "ruler" / "summary.md").read_text()


def test_compare_pairs_ruler_samples(runs, tmp_path, capsys):
    from longdoc.cli import main
    from longdoc.eval import report

    assert main(["eval", "compare", str(runs / "a"), str(runs / "a"), "--names", "base", "tuned",
                 "--out", str(tmp_path / "same")]) == 0
    same = report.load_results(tmp_path / "same")["ruler"]
    assert same["overall"]["paired"]["n"] == 4 and same["overall"]["paired"]["noise"]
    assert set(same["by_task"]) == {"niah_single", "qa"} and "qa@1024" in same["cells"]
    assert "ruler all tasks: base" in capsys.readouterr().out
    assert (tmp_path / "same" / "compare_ruler.png").stat().st_size > 1000
    # Another seed makes other samples: nothing pairs, and the report says so.
    assert main(["eval", "compare", str(runs / "a"), str(runs / "b"), "--out", str(tmp_path / "other")]) == 0
    other = report.load_results(tmp_path / "other")["ruler"]
    assert other["unpaired"] == 4 and other["overall"]["paired"]["n"] == 0
    assert "have no twin" in (tmp_path / "other" / "summary.md").read_text()


def test_bad_settings_fail_before_any_compute(tmp_path):
    from longdoc.cli import main

    with pytest.raises(ValueError, match="unknown 'needle'; choose from niah_single"):
        main(["eval", "ruler", "--model", "tiny:llama", "--ruler-tasks", "needle", "--cp", "2"])
    with pytest.raises(ValueError, match="at least 1024"):
        main(["eval", "ruler", "--model", "tiny:llama", "--lengths", "512", "--cp", "2"])
    with pytest.raises(ValueError, match="batch-size must be auto or an integer"):
        main(["eval", "ruler", "--model", "tiny:llama", "--batch-size", "0", "--cp", "2"])
    # A length past the model's context names the limit (tiny:llama here has 2048 positions).
    from longdoc.eval.ruler.run import evaluate
    from longdoc.models import load
    from longdoc.parallel.api import ContextParallel

    model, tok = load("tiny:llama", max_position_embeddings=2048)
    with pytest.raises(Exception, match=r"--lengths 4096 .*exceeds the model's context \(2048 tokens\)"):
        evaluate(model.eval(), tok, ContextParallel(), {"lengths": [1024, 4096], "samples": 1})


def test_the_users_documents_are_the_needle_haystack(builder, tok, tmp_path):
    """`--haystack FILE|FOLDER`: the needle tasks' filler is the user's own sentences (hard wraps read as prose),
    every sample still exact in length and a pure function of its arguments and the text."""
    from longdoc.eval.ruler.generate import document_haystack

    text = ("The Licensee shall pay the royalty within thirty days of each\nquarter's end. Either party may "
            "terminate this Agreement on ninety days' notice. ") * 3 + "Notices go to the registered office."
    name = document_haystack([text])
    assert name.startswith("documents:") and document_haystack([text]) == name
    a, b = _make(builder, "niah_single", haystack=name), _make(builder, "niah_single", haystack=name)
    assert a.ids == b.ids and len(a.ids) == 1536 - TASKS["niah_single"].max_new_tokens
    prompt = tok.decode(a.ids)
    assert "royalty within thirty days of each quarter's end" in prompt and "terminate this Agreement" in prompt
    assert a.references[0] in prompt


def test_eval_ruler_reads_a_haystack_folder(tmp_path, capsys):
    """Every readable file is filler; with --skip-bad an image in the folder is left out and named."""
    from longdoc.cli import main
    from longdoc.eval import report

    folder = tmp_path / "contracts"
    folder.mkdir()
    (folder / "a.txt").write_text("The Seller warrants title to the goods. Risk passes on delivery.\n" * 40)
    (folder / "b.md").write_text("# Terms\n\nPayment is due within 30 days of invoice.\n" * 40)
    (folder / "stamp.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(16))
    out = tmp_path / "r"
    assert main(["eval", "ruler", "--model", "tiny:llama", "--threads", "1", "--lengths", "1024", "--samples", "1",
                 "--ruler-tasks", "niah_single", "--haystack", str(folder), "--skip-bad", "--out", str(out)]) == 0
    res = report.load_results(out)
    assert res["haystack"].startswith("documents:") and res["skipped"]["total"] == 1
    printed = capsys.readouterr()
    assert "--haystack skipped 1 bad item(s): 1 unsupported file type" in printed.out and "stamp.png" in printed.err
