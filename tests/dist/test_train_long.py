"""Long sequences on this machine (slow): a tiny model at 32k and 64k tokens, the real 135M at 16k, cp=2 vs 1.

    .venv/bin/python -m pytest -m slow -s tests/dist/test_train_long.py     # prints step time / peak memory

The tiny model keeps the real 49k-token vocabulary, so full fp32 logits would be 6.4 GB at 32k tokens and
12.9 GB at 64k: the peak-memory bounds below hold only because the chunked loss never builds them.
"""

from __future__ import annotations

import pytest

from tests.support.distributed import run_ranks
from tests.support.training import accelerate_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * 3600)]


def measure_on_ranks(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    h = train(recipe_from_dict(recipe, overrides)).history
    return [(s.loss, s.step_s, s.peak_gb) for s in h]


def long_recipe(out, model: str, seq_len: int, steps: int, lora: bool = False, rope_factor: float = 1.0) -> dict:
    return {
        "output_dir": str(out),
        "model": {"name": model, **({"rope_type": "yarn", "rope_factor": rope_factor} if rope_factor > 1 else {})},
        "lora": {"enabled": lora},
        "data": {"path": "random", "seq_len": seq_len, "random_size": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"steps": steps, "batch_size": 1, "loss_chunk_tokens": 1024},
        "checkpoint": {"at_end": False, "export": False},
        "log": {"progress": False, "tensorboard": False, "plot": False},
    }


def _report(name: str, rows: dict) -> None:
    print(f"\n{name}: step time (last step) and peak RSS per rank")
    for label, per_rank in rows.items():
        last = [r[-1] for r in per_rank]
        print(f"  {label:6s} step {max(x[1] for x in last):7.1f} s   peak/rank "
              + " ".join(f"{x[2]:.2f} GB" for x in last) + f"   loss {last[0][0]:.4f}")


@pytest.mark.parametrize("seq_len", [32768, 65536])
def test_tiny_model_long_sequences_cp2_vs_cp1(tmp_path, seq_len):
    rec = long_recipe(tmp_path / "r", "tiny:llama", seq_len, steps=2)
    rows = {
        "cp=1": run_ranks(1, measure_on_ranks, rec, ["output_dir=" + str(tmp_path / "c1")], threads=2, deadline=3000,
                          pg_timeout=1800),
        "cp=2": run_ranks(2, measure_on_ranks, rec, ["parallelism.cp_size=2", "output_dir=" + str(tmp_path / "c2")],
                          deadline=3000, pg_timeout=1800),
    }
    _report(f"tiny:llama (vocab 49152) at {seq_len} tokens", rows)
    for per_rank in rows.values():
        for steps in per_rank:
            assert all(loss == loss and loss < 20 for loss, _, _ in steps)
    # the same global loss from both layouts (fp32)
    assert rows["cp=2"][0][0][0] == pytest.approx(rows["cp=1"][0][0][0], rel=1e-5)
    full_logits_gb = seq_len * 49152 * 4 / 2**30
    assert max(s[-1][2] for s in rows["cp=2"]) < full_logits_gb  # less than the fp32 logits alone


def test_real_135m_16k_step_cp2_vs_cp1(tmp_path):
    # 16k is twice SmolLM2's pretrained context: extended with YaRN x2, as a real 16k fine-tune would be
    rec = long_recipe(tmp_path / "r", "SmolLM2-135M-Instruct", 16384, steps=1, lora=True, rope_factor=2.0)
    rows = {
        "cp=1": run_ranks(1, measure_on_ranks, rec, ["output_dir=" + str(tmp_path / "c1")], threads=2, deadline=5000,
                          pg_timeout=1800),
        "cp=2": run_ranks(2, measure_on_ranks, rec, ["parallelism.cp_size=2", "output_dir=" + str(tmp_path / "c2")],
                          deadline=5000, pg_timeout=1800),
    }
    _report("SmolLM2-135M-Instruct + LoRA at 16384 tokens", rows)
    assert rows["cp=2"][0][0][0] == pytest.approx(rows["cp=1"][0][0][0], rel=1e-4)
