"""`longdoc verify`'s verdict: tolerances by dtype, FAIL exits non-zero."""

from __future__ import annotations

from longdoc.cli import build_parser
from longdoc.hf.verify import Spec, _report, verdict


def _result(cp_err, single_err=None):
    out = {"cp_vs_single": cp_err, "loss": (1.0, 1.0)}
    if single_err is not None:
        out["cp_vs_fp64"], out["single_vs_fp64"] = cp_err, single_err
    return out


def test_fp32_passes_small_errors_and_fails_large_ones(capsys):
    spec = Spec("tiny:llama", 2, 64)
    ok, rows = verdict(spec, _result([1e-6, 1e-7, 1e-7, 1e-6]))
    assert ok and [r[0] for r in rows] == ["logits err / max |logit|", "loss abs err", "grads max rel err"]
    assert _report(spec, _result([1e-6, 1e-7, 1e-7, 1e-6])) == 0
    assert "PASS: tiny:llama under CP=2 matches" in capsys.readouterr().out
    assert _report(spec, _result([0.5, 0.1, 1e-7, 1e-6])) == 1
    out = capsys.readouterr().out
    assert "FAIL: tiny:llama under CP=2 does NOT match" in out and "FAIL\n" in out


def test_bf16_is_judged_against_the_single_process_rounding_error():
    spec = Spec("tiny:llama", 2, 64, dtype="bfloat16")
    single = [4e-2, 1e-2, 2e-4, 3e-2]
    assert verdict(spec, _result([4e-2, 1.5e-2, 3e-4, 4e-2], single))[0]
    assert not verdict(spec, _result([1.0, 0.3, 3e-4, 4e-2], single))[0]  # logits 30x worse than rounding


def test_verify_is_a_registered_verb():
    args = build_parser().parse_args(["verify", "--model", "tiny:qwen3", "--cp", "2", "--seq-len", "100"])
    assert (args.model, args.cp, args.seq_len, args.dtype, args.layout, args.strategy) == (
        "tiny:qwen3", 2, 100, "float32", "zigzag", "ring")


def test_verify_names_the_layer_kinds_and_the_router_loss():
    from longdoc.hf.verify import kinds_exercised

    assert kinds_exercised({}, False) == []
    assert kinds_exercised({"mamba": 1, "shortconv": 0, "new_kind": 2}, True) == [
        "state passing (Mamba selective scan) and conv halos (1 layer)", "new_kind layers (2 layers)",
        "router load-balancing loss (each rank's share of its tokens, summed over the group)"]


def test_every_tiny_sparse_model_has_an_indexer_per_layer():
    from longdoc import models
    from longdoc.hf import kinds

    assert models.TINY_SPARSE and set(models.TINY_SPARSE) <= set(models.TINY_NAMES)
    for arch in models.TINY_SPARSE:
        model = models.tiny_model(arch)
        found = [k.name for _, _, k in kinds.find(model)]
        assert found == ["dsa_indexer"] * model.config.num_hidden_layers, (arch, found)
        assert model.config.index_topk < 40  # sparse at any sensible --seq-len
