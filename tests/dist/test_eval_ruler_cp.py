"""The RULER-style suite at cp=2 with batched prompts against cp=1 one prompt at a time, and against
transformers' own greedy decoding (gloo, 2 ranks, tiny model)."""

from __future__ import annotations

import pytest

from tests.support.distributed import run_ranks

CFG = {"lengths": [1024], "samples": 3, "ruler_tasks": "niah_multivalue,vt,cwe,qa", "seed": 4}


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import longdoc
    from longdoc.eval.prompts import Prompter
    from longdoc.eval.ruler.build import Builder
    from longdoc.eval.ruler.generate import TASKS, make
    from longdoc.eval.ruler.run import evaluate
    from longdoc.models import load

    model, tok = load("tiny:llama", seed=2)
    model.eval()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    two = evaluate(model, tok, longdoc.ContextParallel(timeout=120), {**CFG, "batch_size": 3})
    one = evaluate(model, tok, longdoc.ContextParallel(singles[rank], timeout=120), {**CFG, "batch_size": 1})
    refs = []
    stops = Prompter(tok).stop_ids()
    for task in ("vt", "qa"):  # transformers' generate on the same ids (its own sdpa attention and cache)
        s = make(task, 1024, 1, seed=CFG["seed"], haystack="prose", builder=Builder(tok))
        with torch.no_grad():
            out = model.generate(torch.tensor([s.ids]), max_new_tokens=TASKS[task].max_new_tokens, do_sample=False,
                                 eos_token_id=stops, pad_token_id=stops[0])[0, len(s.ids):].tolist()
        cut = next((k for k, t in enumerate(out) if t in stops), len(out))
        refs.append((task, 1, tok.decode(out[:cut], skip_special_tokens=True)))
    rows = lambda res: [(r["task"], r["index"], r["prediction"], r["score"]) for r in res["rows"]]  # noqa: E731
    return {"two": rows(two), "one": rows(one), "refs": refs, "grid": two["grid"],
            "impl": model.config._attn_implementation}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, _worker, deadline=900, pg_timeout=120)


def test_cp2_batched_equals_cp1_one_by_one_on_every_rank(results):
    for res in results:
        assert len(res["two"]) == 12
        assert res["two"] == res["one"]
    assert results[0]["two"] == results[1]["two"]


def test_predictions_equal_transformers_greedy_decoding(results):
    for res in results:
        for task, index, prediction in res["refs"]:
            ours = next(p for t, i, p, _ in res["two"] if t == task and i == index)
            assert ours == prediction, (task, ours, prediction)
        assert res["impl"] == "sdpa", "the sessions must leave the model's attention implementation as it was"
