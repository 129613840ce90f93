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


def test_verify_reports_every_layer_kind_it_exercised(tmp_path, capsys):
    # A DSA model: its attention layers are "full causal" to the mask, and the top-k selection is what CP runs
    rc = main(["verify", "--model", "tiny:deepseek_v32", "--cp", "2", "--seq-len", "40", "--threads", "1",
               "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS:" in out, out
    assert "layer kinds exercised: selected keys (DSA: each query's top-k over every earlier key of the whole " \
           "sequence) (3 layers)" in out, out
    # Granite-4-H with its router loss on: state passing and halos in 2 Mamba2 layers, the load-balancing term
    from longdoc import models

    path = tmp_path / "config.json"
    models.tiny_config("granitemoehybrid", output_router_logits=True).to_json_file(str(path))
    rc = main(["verify", "--model", str(path), "--cp", "2", "--seq-len", "40", "--threads", "1", "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS:" in out, out
    line = next(x for x in out.splitlines() if x.startswith("layer kinds exercised: "))
    assert line == ("layer kinds exercised: state passing (Mamba2 SSD) and conv halos (2 layers); router "
                    "load-balancing loss (each rank's share of its tokens, summed over the group)"), out
    assert "full causal (1 of 1 layers)" in out, out
