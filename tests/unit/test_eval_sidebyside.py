"""The demo's last words: the held-out QA gain beside the guard's verdict, read from the reports as written, and
one plot; unreadable reports are one line and exit 2."""

from __future__ import annotations

from longdoc.eval import report, sidebyside


def _reports(tmp_path, low: float):
    kind = {"em": {"a": 0.0, "b": 0.4}, "f1": {"a": 0.05, "b": 0.4}}
    report.write_json(tmp_path / "cmp" / "results.json", {"task": "compare", "qa": {
        "overall": {"f1": {"a": 0.05, "b": 0.30}, "em": {"a": 0.0, "b": 0.25}},
        "paired": {"f1": {"n": 43, "delta": 0.25, "low": low, "high": 0.38}},
        "by_kind": {"count": kind, "lookup": kind}}})
    report.write_json(tmp_path / "guard" / "results.json", {
        "task": "guard", "verdict": "NO HARM", "line": "guard: NO HARM (needle 0.60 -> 0.57, ...)",
        "plot": {"needle": {"lengths": [1024, 2048], "a": [0.6, 0.6], "b": [0.55, None]}}})


def test_prints_both_lines_and_writes_the_plot(tmp_path, capsys):
    _reports(tmp_path, low=0.12)
    png = tmp_path / "outcome.png"
    assert sidebyside.main([str(tmp_path / "cmp"), str(tmp_path / "guard"), "--out", str(png), "--started", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("held-out QA: F1 0.050 -> 0.300 (+0.250, 95% CI [+0.120, +0.380], a gain), EM 0.000 -> 0.250, "
                      "on 43 questions")
    assert out[1] == "guard: NO HARM (needle 0.60 -> 0.57, ...)"
    assert png.stat().st_size > 10_000 and out[-1].startswith("wall time ") and "CPU" in out[-1]
    _reports(tmp_path, low=-0.05)
    sidebyside.main([str(tmp_path / "cmp"), str(tmp_path / "guard"), "--out", str(png)])
    assert "within noise" in capsys.readouterr().out


def test_unreadable_reports_are_one_line_and_exit_2(tmp_path, capsys):
    assert sidebyside.main([str(tmp_path / "none"), str(tmp_path / "none"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sidebyside: cannot read the reports")
