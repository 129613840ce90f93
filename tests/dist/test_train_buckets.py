"""Full fine-tuning and LoRA under dp x cp with gradients in several DDP buckets equal one process (issue 22).

What broke: tiny:llama with the real tokenizer vocabulary (49,152 rows: lm_head is a DDP bucket of its own),
answer-only loss (the loss tokens at the end of each row), zigzag cp=2: CP rank 1 holds the middle chunks and
no loss token, its lm_head got no gradient, its DDP buckets never fired, and its next collective met its peer's
gradient bucket on the shared world group (a gloo abort). The older training tests ran a 256-token vocabulary,
one bucket filled at the very end, and never saw it.

Each world size is spawned once and loops over the cases; every run has LONGDOC_DEBUG_COLLECTIVES=1 (set by
tests.support.training.accelerate_env), so every collective longdoc issues is checked across its group, and each run
asserts the guard really counted DDP buckets and CP ops. Every logged loss and gradient norm, the token counts
and the exported weights are compared with one process.
"""

from __future__ import annotations

import json

from safetensors.torch import load_file

from tests.support.training import max_rel_err, ranks, tiny_recipe, train_cases

SEQ = 96  # 4 zigzag chunks of 24 at cp=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
VOCAB = 49152  # the default tokenizer's: tiny:llama without a vocab override


def _answer_only_rows(path, packed: bool = False) -> str:
    """Rows of SEQ tokens whose loss tokens are the last few (an answer after a long prompt), so CP rank 1
    has none; packed: three documents per row, each with its answer at its end (per-document zigzag gives
    rank 1 the middles of all three)."""
    import torch

    g = torch.Generator().manual_seed(22)
    with open(path, "w") as f:
        for i in range(8):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=g).tolist()
            labels = [-100] * SEQ
            row = {"input_ids": ids}
            docs = (40, 32, 24) if packed else (SEQ,)
            start = 0
            for n in docs:
                answer = 2 + (i + n) % 4  # 2..5 tokens: their targets all inside the document's last zigzag chunk
                labels[start + n - answer:start + n] = ids[start + n - answer:start + n]
                start += n
            row["labels"] = labels
            if packed:
                row["position_ids"] = [p for n in docs for p in range(n)]
            f.write(json.dumps(row) + "\n")
    return str(path)


def _cases(tmp_path, world: str) -> dict[str, dict]:
    plain = _answer_only_rows(tmp_path / "answers.jsonl")
    packed = _answer_only_rows(tmp_path / "packed.jsonl", packed=True)
    model = {"name": "tiny:llama", "overrides": {}}
    data = {"path": plain, "seq_len": SEQ}
    train = {"activation_checkpointing": False, "batch_size": 2, "loss_chunk_tokens": 16}
    cases = {
        # the layout: full fine-tuning, answer-only loss, fp32
        "full": {"model": model, "data": data, "train": train},
        # + activation checkpointing and gradient accumulation (4 micro-batches at cp=2, 2 at dp=2 x cp=2),
        # and small buckets on purpose: the decoder's gradients in several buckets too
        "full-ckpt-accum": {"model": model, "data": data,
                            "train": {**train, "activation_checkpointing": True, "batch_size": 4,
                                      "ddp_bucket_cap_mb": 0.05}},
        # LoRA's 7k parameters would fit one bucket: 10 kB buckets split them
        "lora": {"model": model, "data": data, "train": {**train, "ddp_bucket_cap_mb": 0.01},
                 "lora": {"enabled": True, "r": 8}},
        # packed rows: the documents' answers all land on rank 0 under per-document zigzag
        "full-packed": {"model": model, "data": {**data, "path": packed}, "train": train},
    }
    if world in ("one", "cp2"):
        # bf16 autocast, compared within bf16's tolerance (tests/dist/test_train_bf16.py)
        cases["full-bf16"] = {"model": model, "data": data, "train": {**train, "mixed_precision": "bf16"}}
        # MoE: transformers fuses each layer's experts into one parameter, so routing never leaves one unused
        # (the guard's gradient coverage would name it)
        cases["mixtral"] = {"model": {"name": "tiny:mixtral", "overrides": {}}, "data": data, "train": train}
    return {name: tiny_recipe(tmp_path / world / name, **c) for name, c in cases.items()}


LOSS_RTOL = {"fp32": 1e-5, "bf16": 5e-3}
NORM_RTOL = {"fp32": 1e-5, "bf16": 5e-2}


def test_full_and_lora_dp_cp_with_many_buckets_equal_one_process(tmp_path):
    runs = {"one": (1, []), "cp2": (2, ["parallelism.cp_size=2"]), "dp2cp2": (4, ["parallelism.cp_size=2"])}
    results, recipes = {}, {}
    for world, (n, overrides) in runs.items():
        recipes[world] = _cases(tmp_path, world)
        results[world] = ranks(n, train_cases, recipes[world], overrides, deadline=900)
    errors, checked, worst = [], 0, {}
    for world in ("cp2", "dp2cp2"):
        for name in recipes[world]:
            dtype = "bf16" if "bf16" in name else "fp32"
            ref = results["one"][0][name]
            for rank, res in enumerate(results[world]):
                got = res[name]
                assert len(got["history"]) == len(ref["history"]) == 3, (world, name, rank)
                for (s, loss, tok, gn), (_, rloss, rtok, rgn) in zip(got["history"], ref["history"], strict=True):
                    assert tok == rtok, (world, name, s)
                    worst[f"{dtype} loss"] = max(worst.get(f"{dtype} loss", 0.0), abs(loss - rloss) / abs(rloss))
                    if abs(loss - rloss) > LOSS_RTOL[dtype] * abs(rloss) or abs(gn - rgn) > NORM_RTOL[dtype] * rgn:
                        errors.append(f"{world} {name} rank {rank} step {s}: loss {loss} vs {rloss}, "
                                      f"grad_norm {gn} vs {rgn}")
                    checked += 1
                # the guard ran: DDP's bucket all-reduces went through the comm hook on the grads group, in
                # several buckets per backward (the point of the real vocabulary and the small caps) from the
                # second step on (DDP's first backward fills one bucket of up to 25 MB, then it rebuilds them
                # in gradient order with a 1 MB first bucket: lm_head alone), and the CP ops were tagged
                assert got["guard"]["grads"] >= 1 + 2 * 2, (world, name, got["guard"])
                assert got["guard"]["cp"] > 0 and got["guard"]["scalars"] > 0, (world, name, got["guard"])
            if dtype == "fp32":
                w = load_file(tmp_path / world / name / "final" / "model.safetensors")
                w_ref = load_file(tmp_path / "one" / name / "final" / "model.safetensors")
                err = max_rel_err(w, w_ref)
                worst["fp32 weights"] = max(worst.get("fp32 weights", 0.0), err)
                if err > 1e-5:
                    errors.append(f"{world} {name}: final weights differ from one process by {err:.2e} (relative)")
    print("largest relative difference from one process:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert not errors, "\n".join(errors)
    assert checked == 2 * 3 * (len(recipes["cp2"]) * 2 + len(recipes["dp2cp2"]) * 4) // 2
    # the training moved the weights and the head: the comparison is not between untouched models
    for name in ("full", "full-packed"):
        hist = results["one"][0][name]["history"]
        assert hist[-1][1] < hist[0][1] - 0.05, (name, hist)


def test_the_data_leaves_cp_rank_1_without_loss_tokens(tmp_path):
    """The rows really are the layout that broke: sharded for cp=2, rank 1 holds no loss token, rank 0 all."""

    from longdoc.parallel.batch import shard_batch
    from longdoc.train.config import DataConfig
    from longdoc.train.data import collate, load_sequences
    from tests.support.fake_cp import FakeCP

    for packed in (False, True):
        path = _answer_only_rows(tmp_path / f"rows-{packed}.jsonl", packed)
        seqs = load_sequences(DataConfig(path=path, seq_len=SEQ), None, VOCAB, 0)
        assert seqs.has_positions == packed
        for i in range(len(seqs)):
            full = collate(seqs, [i], 0)
            rank0, rank1 = (shard_batch(full, FakeCP(r, 2))["shift_labels"] for r in (0, 1))
            assert bool((rank1 == -100).all()) and int((rank0 != -100).sum()) >= (6 if packed else 2), (packed, i)
