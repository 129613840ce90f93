"""`longdoc verify` end to end: it spawns its own gloo ranks and prints a PASS verdict."""

from __future__ import annotations

from longdoc.cli import main


def test_verify_cli_passes_on_a_tiny_model_from_a_config_json(tmp_path, capsys):
    from longdoc import models

    path = tmp_path / "config.json"
    models.tiny_config("phi3").to_json_file(str(path))
    rc = main(["verify", "--model", str(path), "--cp", "2", "--seq-len", "37", "--batch-size", "2",
               "--threads", "1", "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS:" in out and "grads max rel err" in out
    # the judged loss error is a real number well inside the fp32 tolerance
    loss_line = next(line for line in out.splitlines() if line.strip().startswith("loss abs err") and "<=" in line)
    assert float(loss_line.split()[3]) <= 1e-5, out


def test_verify_cli_float64_passes_on_an_moe_model(capsys):
    # float64: the experts run eagerly (grouped_mm has no float64 kernel) and the loss is judged as transformers
    # computes it (float32 cross-entropy)
    rc = main(["verify", "--model", "tiny:mixtral", "--cp", "2", "--seq-len", "40", "--dtype", "float64",
               "--threads", "1", "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS:" in out
