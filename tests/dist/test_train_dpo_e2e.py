"""`longdoc train` on preference rows at cp=2: pairs made by `longdoc data pairs` from `data synth` records, read as
data.task: preference, trained with sigmoid DPO (LoRA; the reference is the LoRA-disabled model): it runs, logs TRL's
metrics identical on both ranks and to metrics.jsonl, starts at loss log 2 with zero rewards (LoRA starts as the
identity, so policy == reference), moves the margins, and runs the reference forward once per row (cached after)."""

from __future__ import annotations

import json
import math

from longdoc.cli import main
from longdoc.corpus.synth import synthesize, write_jsonl
from longdoc.corpus.tokens import get_tokenizer
from longdoc.train.dpo import METRICS
from tests.support.dpo_train import train_counting_references
from tests.support.training import ranks, tiny_recipe


def test_longdoc_train_dpo_cp2(tmp_path):
    qa = tmp_path / "qa.jsonl"
    tok = get_tokenizer()
    write_jsonl(synthesize("legal", 2, 1024, seed=0, tokenizer=tok) + synthesize("medical", 2, 1024, tokenizer=tok), qa)
    pairs = tmp_path / "pairs.jsonl"
    assert main(["data", "pairs", str(qa), "--out", str(pairs)]) == 0
    rows = [json.loads(line) for line in pairs.read_text().splitlines()][:4]
    assert len(rows) == 4
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    recipe = tiny_recipe(out, model={"name": "tiny:llama", "overrides": {"tie_word_embeddings": True}},
                         data={"path": str(pairs), "task": "preference", "seq_len": 2048},
                         lora={"enabled": True, "r": 4}, optim={"lr": 1e-2, "warmup_steps": 0},
                         preference={"loss": "sigmoid", "beta": 0.1})
    per_rank = ranks(2, train_counting_references, recipe, ["parallelism.cp_size=2"], deadline=400)
    assert per_rank[0]["steps"] == per_rank[1]["steps"]  # every number identical on both ranks
    steps = per_rank[0]["steps"]
    assert [s for s, *_ in steps] == [1, 2, 3]
    first = steps[0]
    assert math.isclose(first[1], math.log(2), rel_tol=1e-6) and set(first[3]) == set(METRICS)
    assert abs(first[3]["rewards/margins"]) < 1e-6 and first[3]["logps/chosen"] < 0
    assert abs(steps[2][3]["rewards/margins"]) > 1e-4 and all(math.isfinite(x) for *_, m in steps for x in m.values())
    assert [r["references"] for r in per_rank] == [4, 4]  # 4 rows, batch 2: step 3 reads them from the cache
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(name in row for row in logged if "loss" in row for name in METRICS)
