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
