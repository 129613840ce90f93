"""Generation and teacher-forced scoring under CP (gloo, 2 ranks) against single-process references.

One spawn; every case runs inside it. Each rank computes the single-process reference itself (plain
HF forward / DynamicCache decoding with sdpa on the full prompt) and returns what it measured; the
test process asserts, so a failure lists every case at once.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.support.distributed import run_ranks

LOGITS_TOL, NLL_TOL = 1e-4, 1e-5

# (name, arch, prompt length, new tokens, strategy, batch)
GEN_CASES = [
    ("llama-2k", "llama", 2048, 16, "ring", 1),
    ("llama-odd-allgather", "llama", 1001, 12, "allgather", 1),
    ("llama-batch2", "llama", 333, 8, "ring", 2),
    ("llama-1-token-prompt", "llama", 1, 6, "ring", 1),  # rank 1 caches nothing after prefill
    ("qwen3", "qwen3", 517, 8, "ring", 1),
    ("gemma", "gemma", 402, 8, "ring", 1),
    ("stablelm-partial-rope", "stablelm", 389, 8, "ring", 1),
    ("phi3", "phi3", 300, 8, "ring", 1),
    ("llama-odd-ulysses", "llama", 777, 8, "ulysses", 1),  # Ulysses prefill, decoding over the sharded cache
    ("qwen3-batch2-ulysses", "qwen3", 333, 8, "ulysses", 2),
]


def reference_greedy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process greedy decoding with the model's own attention and a DynamicCache."""
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].float()
        tokens, seen = [], []
        for i in range(n):
            tokens.append(logits.argmax(-1))
            seen.append(logits)
            if i < n - 1:
                logits = model(input_ids=tokens[-1][:, None], cache=cache, use_cache=True).logits[:, -1].float()
    return torch.stack(tokens, 1), torch.stack(seen, 1)


def reference_nll(model, prompt: torch.Tensor, answer: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Answer NLL and argmax tokens from one single-process forward over prompt + answer."""
    ids = torch.cat([prompt, answer], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.shape[1] - 1 : -1].double()
    logp = torch.log_softmax(logits, -1).gather(-1, answer[0, :, None]).squeeze(-1)
    return float(-logp.sum()), logits.argmax(-1)


def _ids(seed: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _worker(rank: int, world: int) -> dict:
    import longdoc
    from longdoc.eval.scoring import answer_score
    from longdoc.hf.session import KVSession, generate
    from longdoc.models import tiny_model

    cp = longdoc.ContextParallel(timeout=60)
    out: dict = {}
    for i, (name, arch, length, n_new, strategy, batch) in enumerate(GEN_CASES):
        model = tiny_model(arch, seed=i).eval()
        ids = _ids(i, batch, length)
        ref_tokens, ref_logits = reference_greedy(model, ids, n_new)
        # eos_token_id=[]: no early stop, as the reference
        got = generate(model, cp, ids, n_new, strategy=strategy, return_logits=True, eos_token_id=[])
        out[name] = dict(tokens=got.tokens.tolist(), ref_tokens=ref_tokens.tolist(),
                         logits_err=float((got.logits - ref_logits).abs().max()),
                         impl=model.config._attn_implementation)

    # A document prefilled once, two questions each extended, answered greedily and scored, with rollbacks
    # in between: everything must match single-process runs on the concatenated ids.
    model = tiny_model("llama", seed=7).eval()
    longdoc.patch(model, cp)  # a patched model is unpatched for the session and re-patched after it
    doc = _ids(100, 1, 1500)
    questions = [_ids(101, 1, 23), _ids(102, 1, 9)]
    answers = [_ids(103, 1, 7), _ids(104, 1, 1)]
    with KVSession(model, cp) as session:
        session.prefill(doc)
        start = session.mark()
        for j, (q, a) in enumerate(zip(questions, answers)):
            logits = session.extend(q)[:, -1]
            asked = session.mark()
            gen = session.greedy(logits, 10, return_logits=True)
            session.rollback(asked)
            score = answer_score(session, logits, a)
            session.rollback(start)
            hf = model  # reference: the same weights through plain sdpa
            hf.set_attn_implementation("sdpa")
            ref_tokens, ref_logits = reference_greedy(hf, torch.cat([doc, q], 1), 10)
            ref_nll, ref_argmax = reference_nll(hf, torch.cat([doc, q], 1), a)
            hf.set_attn_implementation(longdoc.hf.attention.NAME)
            out[f"qa{j}"] = dict(tokens=gen.tokens.tolist(), ref_tokens=ref_tokens.tolist(),
                                 logits_err=float((gen.logits - ref_logits).abs().max()),
                                 nll=score.nll, ref_nll=ref_nll, argmax_tokens=score.argmax_tokens,
                                 ref_argmax_tokens=int((ref_argmax == a[0]).sum()))
    out["repatched"] = (longdoc.hf.is_patched(model), model.config._attn_implementation)
    out.update(_sampling_and_model_generate(rank, world, cp))
    out.update(_eval_pipeline(cp))
    out.update(_needle_batches(cp))
    out.update(_branches(cp))

    # Ranks that disagree (a bug in the caller) all get the same clear error instead of hanging.
    with KVSession(tiny_model("llama").eval(), cp) as session:
        session.prefill(_ids(5, 1, 64))
        try:
            session.extend(_ids(6, 1, 2 + rank))
            out["disagree"] = "no error"
        except ValueError as e:
            out["disagree"] = str(e)
    return out


def _sampling_and_model_generate(rank: int, world: int, cp) -> dict:
    """Seeded sampling and a patched model's model.generate at cp=2, against the same calls at cp=1."""
    import torch.distributed as dist

    import longdoc
    from longdoc.models import tiny_model

    singles = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    cp1 = longdoc.ContextParallel(singles[rank], timeout=60)
    model = tiny_model("llama", seed=11).eval()
    ids = _ids(200, 2, 301)
    out = {}
    settings = [dict(temperature=0.7, seed=1), dict(top_p=0.9, seed=2), dict(top_k=20, temperature=1.3, seed=3)]
    for j, kw in enumerate(settings):
        two = longdoc.hf.generate(model, cp, ids, 12, do_sample=True, **kw).tokens
        one = longdoc.hf.generate(model, cp1, ids, 12, do_sample=True, **kw).tokens
        other_seed = longdoc.hf.generate(model, cp1, ids, 12, do_sample=True, **{**kw, "seed": kw["seed"] + 10})
        out[f"sample{j}"] = (two.tolist(), one.tolist(), other_seed.tokens.tolist())
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)  # transformers' own loop, unpatched
    torch.manual_seed(5)  # model.generate samples from torch's global generator; rank 0's draw decides
    ref_sample = longdoc.hf.generate(model, cp1, ids, 8, do_sample=True, top_k=50).tokens
    for name, group in (("cp2", cp), ("cp1", cp1)):
        longdoc.patch(model, group)
        greedy = model.generate(ids, max_new_tokens=8, attention_mask=torch.ones_like(ids))
        torch.manual_seed(5)
        sampled = model.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=50)
        try:
            model.generate(ids, max_new_tokens=8, num_beams=2)
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        longdoc.hf.unpatch(model)
        out[f"model.generate-{name}"] = (greedy.tolist(), ref.tolist(), sampled[:, 301:].tolist(),
                                         ref_sample.tolist(), refused)
    return out


def _eval_pipeline(cp) -> dict:
    """qa.evaluate and position.evaluate at CP=2 against plain single-process runs of the same ids."""
    import torch.nn.functional as F

    from longdoc.eval import position, qa
    from longdoc.eval.prompts import Prompter
    from longdoc.models import load

    model, tok = load("tiny:llama", seed=3)  # the real tokenizer's vocabulary
    model.eval()
    doc = " ".join(f"Entry {i}: the clerk filed motion {i * 7 % 31} on day {i}." for i in range(60))
    record = {"id": "d0", "domain": "legal", "num_tokens": 900, "document": doc,
              "qa": [{"kind": "lookup", "question": "Which motion was filed on day 5?", "answer": "motion 4",
                      "depth": 0.1}, {"kind": "count", "question": "How many entries?", "answer": "60", "depth": 0.9}]}
    rows = qa.evaluate(model, tok, [record], cp, max_new_tokens=6, progress=False)
    p = Prompter(tok)
    ref = []
    for q in record["qa"]:
        prompt = torch.tensor([p.prefix(doc) + p.suffix(q["question"])])
        tokens, _ = reference_greedy(model, prompt, 6)
        nll, _ = reference_nll(model, prompt, torch.tensor([p.answer(q["answer"])]))
        ref.append((p.decode_answer(tokens[0].tolist()), nll))
    out = {"qa_rows": [(r["prediction"], r["nll"]) for r in rows], "qa_ref": ref}

    texts = [doc, doc[::-1], "too short"]
    res = position.evaluate(model, tok, cp, {"length": 301, "buckets": 7, "texts": texts})
    sums = torch.zeros(7, 2, dtype=torch.float64)
    edges = torch.tensor(res["edges"][1:-1])
    for text in texts:
        ids = tok(text)["input_ids"][:301]
        if len(ids) < 301:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        ce = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        b = torch.bucketize(torch.arange(1, 301), edges, right=True)
        sums[:, 0].index_add_(0, b, ce)
        sums[:, 1].index_add_(0, b, torch.ones_like(ce))
    out["pl"] = (res["mean_loss"], (sums[:, 0] / sums[:, 1]).tolist(), res["documents"], res["skipped"],
                 res["tokens"], sums[:, 1].tolist())
    return out


def _needle_batches(cp) -> dict:
    """needle.evaluate with cells of equal prompt length decoded together (--needle-batch 8) against one cell at a
    time (--needle-batch 1), and the groups it formed: the two question templates differ by a token or two."""
    from longdoc.eval import needle
    from longdoc.eval.prompts import Prompter
    from longdoc.models import load

    model, tok = load("tiny:llama", seed=3)
    model.eval()
    cfg = {"domain": "legal", "lengths": [128, 256], "depths": [0.0, 0.5, 1.0], "repeats": 2, "max_new_tokens": 6}
    stacks = needle.haystacks("legal", 256, 2, 0, tok)
    todo = needle.prompts(model, tok, cfg, Prompter(tok), stacks)
    sizes = [len(p["ids"]) for p in todo]
    batched = needle.evaluate(model, tok, cp, {**cfg, "needle_batch": 8})
    alone = needle.evaluate(model, tok, cp, {**cfg, "needle_batch": 1})
    return {"needle": dict(batched=batched, alone=alone, sizes=sizes, lengths=[p["j"] for p in todo],
                           groups=needle.groups(sizes, 8))}


BRANCH_QUESTIONS, BRANCH_ANSWERS = (23, 9, 1, 15, 4), (7, 1, 3, 12, 2)


def _branches(cp) -> dict:
    """Questions of different lengths about one prefilled document, decoded as one batch (longdoc.hf.branches),
    against single-process sdpa runs of each question on its own: greedy tokens up to each row's EOS (rows leave
    the batch there), their logits, and the answers' teacher-forced NLL; on two GQA models. A sliding-window model
    is refused by name before any compute."""
    from longdoc.eval.scoring import score_logits
    from longdoc.hf.branches import Branches
    from longdoc.hf.session import KVSession
    from longdoc.models import tiny_model

    out = {}
    for arch in ("llama", "qwen3"):
        model = tiny_model(arch, seed=9).eval()
        doc = _ids(300, 1, 700)
        qs = [_ids(310 + j, 1, n) for j, n in enumerate(BRANCH_QUESTIONS)]
        answers = [_ids(320 + j, 1, n)[0] for j, n in enumerate(BRANCH_ANSWERS)]
        refs = [reference_greedy(model, torch.cat([doc, q], 1), 10) for q in qs]
        nll_refs = [reference_nll(model, torch.cat([doc, q], 1), a[None])[0] for q, a in zip(qs, answers)]
        eos = int(refs[0][0][0, 2])  # row 0 stops at its third token; the others where this token first appears
        with KVSession(model, cp) as session:
            session.prefill(doc)
            with Branches(session, len(qs)) as br:
                last = br.extend([q[0].tolist() for q in qs])
                asked = br.mark()
                scored = br.extend([a[:-1].tolist() for a in answers], keep_all=True)
                nlls = [score_logits(torch.cat([last[r:r + 1], sc]), a).nll
                        for r, (sc, a) in enumerate(zip(scored, answers))]
                br.rollback(asked)
                first = (last - torch.stack([r[1][0, 0] for r in refs])).abs().max()
                tokens = br.greedy(last, 10, eos_token_id=eos)
            # the session is its plain self again: one more question the one-row way
            tail = session.extend(qs[1])[:, -1]
        expected = []
        for ref_tokens, _ in refs:
            row = ref_tokens[0].tolist()
            expected.append(row[:row.index(eos) + 1] if eos in row else row)
        out[f"branches-{arch}"] = dict(tokens=tokens, expected=expected, nll=nlls, ref_nll=nll_refs,
                                       logits_err=float(first), tail_err=float((tail - refs[1][1][0, 0]).abs().max()))
    with KVSession(tiny_model("gemma2", seed=1).eval(), cp) as session:
        session.prefill(_ids(5, 1, 64))
        try:
            Branches(session, 2)
            out["branches-refused"] = "no error"
        except ValueError as e:
            out["branches-refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, _worker, deadline=400, pg_timeout=120)


@pytest.mark.parametrize("case", [c[0] for c in GEN_CASES] + ["qa0", "qa1"])
def test_cp2_greedy_equals_single_process(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["tokens"] == r["ref_tokens"], f"rank {rank}: {r['tokens']} != {r['ref_tokens']}"
        # Close logits, not just the same argmax: a greedy tie could hide a wrong merge.
        assert r["logits_err"] < LOGITS_TOL, f"rank {rank}: logits differ by {r['logits_err']:.2e}"
        if "impl" in r:
            assert r["impl"] == "sdpa", "the session must restore the model's attention implementation"
    assert results[0][case]["tokens"] == results[1][case]["tokens"]


@pytest.mark.parametrize("case", ["qa0", "qa1"])
def test_teacher_forced_nll_matches_single_forward(results, case):
    for res in results:
        r = res[case]
        assert abs(r["nll"] - r["ref_nll"]) < NLL_TOL, (r["nll"], r["ref_nll"])
        assert r["argmax_tokens"] == r["ref_argmax_tokens"]


def test_qa_pipeline_matches_single_process(results):
    for res in results:
        assert [r[0] for r in res["qa_rows"]] == [r[0] for r in res["qa_ref"]]
        for (_, nll), (_, ref) in zip(res["qa_rows"], res["qa_ref"]):
            assert abs(nll - ref) < NLL_TOL


def test_needle_cells_decoded_together_equal_one_at_a_time(results):
    for res in results:
        r = res["needle"]
        assert r["batched"] == r["alone"], "--needle-batch 8 changed the needle results"
        assert len(r["batched"]["cells"]) == 12 and any(c["prediction"] for c in r["batched"]["cells"])
        groups = r["groups"]
        assert max(len(g) for g in groups) > 1, f"no group decoded several cells: {groups}"
        assert sorted(k for g in groups for k in g) == list(range(12))
        for g in groups:
            assert len({r["sizes"][k] for k in g}) == 1, f"a group mixes prompt lengths: {g} {r['sizes']}"
        # a longer question takes its tokens from the haystack: the cells of a length share one prompt length and
        # batch together (groups of mixed lengths: tests/unit/test_eval_prompts.py)
        for n in set(r["lengths"]):
            assert len({size for size, m in zip(r["sizes"], r["lengths"]) if m == n}) == 1, (n, r["sizes"])
    assert results[0]["needle"]["batched"] == results[1]["needle"]["batched"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_branches_decode_every_question_as_alone(results, arch):
    for rank, res in enumerate(results):
        r = res[f"branches-{arch}"]
        assert r["tokens"] == r["expected"], f"rank {rank}: {r['tokens']} != {r['expected']}"
        assert [len(t) for t in r["tokens"]][0] == 3, "row 0 must stop at its EOS"
        assert max(abs(a - b) for a, b in zip(r["nll"], r["ref_nll"])) < NLL_TOL, (r["nll"], r["ref_nll"])
        assert r["logits_err"] < LOGITS_TOL and r["tail_err"] < LOGITS_TOL, (r["logits_err"], r["tail_err"])
    assert results[0][f"branches-{arch}"]["tokens"] == results[1][f"branches-{arch}"]["tokens"]


def test_branches_refuse_a_sliding_window_model_by_name(results):
    for res in results:
        assert "sliding-window" in res["branches-refused"] and "one row at a time" in res["branches-refused"]


def test_position_loss_matches_single_process(results):
    for res in results:
        means, ref, docs, skipped, tokens, ref_tokens = res["pl"]
        assert (docs, skipped) == (2, 1)
        assert tokens == ref_tokens and sum(tokens) == 2 * 300
        assert max(abs(a - b) for a, b in zip(means, ref)) < 1e-5


def test_disagreeing_ranks_raise_everywhere(results):
    for res in results:
        assert "CP ranks disagree" in res["disagree"] and "rank 1: ids (1, 3)" in res["disagree"]


@pytest.mark.parametrize("case", ["sample0", "sample1", "sample2"])
def test_seeded_sampling_is_the_same_at_cp2_and_cp1_and_on_every_rank(results, case):
    two, one, other_seed = results[0][case]
    assert two == one, f"cp=2 sampled {two}, cp=1 {one}"
    assert results[1][case][0] == two, "the ranks sampled different tokens"
    assert other_seed != one, "another seed should sample other tokens"


@pytest.mark.parametrize("cp", ["cp1", "cp2"])
def test_patched_model_generate_routes_through_the_cp_session(results, cp):
    for res in results:
        greedy, ref, sampled, ref_sample, refused = res[f"model.generate-{cp}"]
        assert greedy == ref, "a patched model's model.generate differs from transformers' greedy decoding"
        assert sampled == ref_sample
        assert "num_beams" in refused and "longdoc.hf.generate(model, cp, input_ids, max_new_tokens" in refused


def test_patched_model_is_repatched(results):
    for res in results:
        assert res["repatched"] == (True, "longdoc_cp")
