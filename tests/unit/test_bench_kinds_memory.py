"""The per-kind memory benchmark (longdoc.bench.kinds_memory) end to end at smoke size: one process and two gloo
ranks per kind, every JSON field there, every ratio finite and positive (the 0.55 / 0.65 targets live in the
benchmark at 8k tokens, not here), and the report rendered alone and as a `longdoc bench` section."""

from __future__ import annotations

import json
import math

import torch

from longdoc.bench import kinds_memory, suite
from longdoc.bench.sections import SECTIONS


def test_quick_run_writes_every_field(tmp_path):
    path = tmp_path / "kinds.json"
    assert kinds_memory.main(["--quick", "--json", str(path)]) == 0  # --quick: exit 0 whatever the ratios
    res = json.loads(path.read_text())
    assert res["config"]["seq_len"] == kinds_memory.QUICK.seq_len and res["config"]["ranks"] == 2
    assert [r["model"] for r in res["rows"]] == list(kinds_memory.MODELS)
    assert {r["kind"] for r in res["rows"]} == {"attention", "Mamba2 hybrid", "Gated DeltaNet hybrid", "DSA", "MoE"}
    for key in ("load_start", "load_end", "loadavg_start", "loadavg_end", "passed", "targets"):
        assert key in res, key
    for row in res["rows"]:
        assert len(row["cp"]) == 2, row["model"]  # one entry per rank
        for run in [row["cp1"], *row["cp"]]:
            for key in ("saved_bytes", "peak_bytes", "rss_growth_bytes", "live_after_forward", "step_s"):
                assert key in run, (row["model"], key)
            assert 0 < run["saved_bytes"] <= run["peak_bytes"], row["model"]  # saved tensors are alive at the peak
            assert run["top_at_peak"] and run["top_saved"], row["model"]
        for name, value in row["ratios"].items():
            assert math.isfinite(value) and value > 0, (row["model"], name, value)
        assert row["meets_tracked"] == (row["ratios"]["peak"] <= res["targets"]["tracked"])
        assert row["meets_rss"] == (row["ratios"]["rss_growth"] <= res["targets"]["rss"])
    md = kinds_memory.to_markdown(res)
    assert all(f"| {m} |" in md for m in kinds_memory.MODELS)
    result = {"machine": {"cpu": "Test CPU", "cpus": 2, "torch": "2.13.0", "python": "3.11"}, "started": "?",
              "load_start": 0.1, "load_end": 0.1, "sections": {"kinds": res}}
    assert "#### Per-rank activation memory by layer kind" in suite.to_markdown(result)
    assert "kinds" in SECTIONS


def test_live_bytes_follow_frees_and_skip_ignored():
    keep = torch.zeros(1000)
    names = []
    with kinds_memory.LiveBytes([keep], lambda: "here") as live:
        keep.add_(1)  # in place on an ignored storage: not counted
        a = torch.ones(256)  # 1 KiB
        b = a[:10] * 2  # 40 bytes; the view a[:10] shares a's storage
        names.append(dict(live.by_owner))
        del a
        after_free = live.live
    assert live.peak == 256 * 4 + 10 * 4 and after_free == 10 * 4 and names == [{"here": live.peak}]
    del b
