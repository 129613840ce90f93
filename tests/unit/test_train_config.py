"""Recipes: typed loading, overrides, errors that name the key and the fix; launch-layout checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from longdoc.train.config import RecipeError, load_recipe, recipe_from_dict
from longdoc.train.world import check_launch

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_defaults_and_dotted_overrides():
    r = recipe_from_dict({"data": {"path": "random"}},
                         ["train.steps=7", "parallelism.cp_size=2", "optim.lr=1e-4",
                          "lora.target_modules=q_proj,v_proj", "resume=true", "model.overrides.num_hidden_layers=3",
                          "optim.max_grad_norm=null"])
    assert (r.train.steps, r.parallelism.cp_size, r.resume) == (7, 2, True)
    assert r.optim.lr == 1e-4 and isinstance(r.optim.lr, float)  # YAML reads "1e-4" as a string
    assert r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.model.overrides == {"num_hidden_layers": 3}
    assert r.optim.max_grad_norm is None
    assert r.flat()["train.steps"] == 7


def test_token_counts_take_k_and_m_suffixes_like_the_command_lines():
    r = recipe_from_dict({"data": {"path": "random", "seq_len": "8k"}},
                         ["train.loss_chunk_tokens=2k", "model.max_position_embeddings=1M"])
    assert (r.data.seq_len, r.train.loss_chunk_tokens, r.model.max_position_embeddings) == (8192, 2048, 1 << 20)
    assert recipe_from_dict({"data": {"path": "random"}}, ["data.seq_len=32_768"]).data.seq_len == 32768


@pytest.mark.parametrize("data, overrides, match", [
    ({"data": {"path": "random"}, "trian": {}}, [], r"unknown recipe key trian \(did you mean train\?\).*output_dir"),
    ({"data": {"path": "random"}}, ["checkpoint.evry=5"], r"checkpoint.evry.*did you mean checkpoint.every.*keep"),
    ({"data": {"path": "random"}}, ["train.steps=many"], r"train.steps: must be an integer, got 'many'"),
    ({"data": {"path": "random"}}, ["train.steps=1k"], r"train.steps: must be an integer, got '1k'"),
    ({"data": {"path": "random"}}, ["data.seq_len=32q"], r"data.seq_len: must be a token count such as 4096, 4k"),
    ({"data": {"path": "random"}}, ["parallelism.layout=zz"],
     r"parallelism.layout: must be one of \('zigzag', 'contiguous'\)"),
    ({"data": {"path": "random"}}, ["parallelism.cp_size=0"], r"parallelism.cp_size: must be >= 1"),
    ({"data": {"path": "random"}}, ["model.rope_type=dynamic"], r"model.rope_type.*'dynamic' NTK is refused"),
    ({"data": {"path": "random"}}, ["train.batch_size=3", "train.micro_batch_size=2"], r"multiple of"),
    ({"data": {"path": "random"}}, ["lora.enabled=maybe"], r"lora.enabled: must be true or false"),
    ({}, [], r"data.path: name a jsonl"),
    ({"data": {"path": "random"}}, ["steps"], r"must look like key=value"),
    ({"data": {"path": "random"}}, ["train=3"], r"train: must be a section"),
])
def test_bad_recipes_fail_with_the_key_and_the_fix(data, overrides, match):
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict(data, overrides)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(tmp_path / "bad.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_load_and_say_how_to_launch(path):
    recipe = load_recipe(path)
    header = path.read_text().split("\n\n", 1)[0]
    assert "accelerate launch" in header or "longdoc train" in header
    assert recipe.data.seq_len >= 4096


def test_launch_layout_checks(monkeypatch):
    r = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.cp_size=2", "train.batch_size=2"])
    assert check_launch(r, 4, cuda=False) == (2, 2)
    assert check_launch(r, 2, cuda=False) == (1, 2)
    with pytest.raises(RecipeError, match=r"parallelism.cp_size=2 must divide the number of processes \(3\)"):
        check_launch(r, 3, cuda=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(RecipeError, match=r"needs at least 2 processes.*use_cpu.*--multi_gpu --num_processes"):
        check_launch(r, 1, cuda=False)
    r3 = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.cp_size=1", "train.batch_size=3"])
    with pytest.raises(RecipeError, match=r"batch_size=3 must be a multiple"):
        check_launch(r3, 2, cuda=False)
    # FSDP2 on CPU: the loop shards with fully_shard itself (tests/dist/test_train_fsdp_cpu.py)
    fsdp1 = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.fsdp=true", "parallelism.cp_size=1"])
    assert check_launch(fsdp1, 1, cuda=False) == (1, 1)


def test_fsdp_on_one_process_trains_as_one_plain_process(capsys, monkeypatch, tmp_path):
    """`longdoc train RECIPE parallelism.cp_size=1 parallelism.fsdp=true` without a launcher: one process has nothing
    to shard, so the run says so in one line and trains unsharded (FSDP's mesh, built anyway, wanted the launcher's
    RANK)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from longdoc.train.world import shards, start

    r = recipe_from_dict({"data": {"path": "random"}, "output_dir": str(tmp_path)},
                         ["parallelism.cp_size=1", "parallelism.fsdp=true", "train.release_freed_memory=false"])
    assert (shards(r, 1), shards(r, 2)) == (False, True)
    assert not shards(recipe_from_dict({"data": {"path": "random"}}, ["parallelism.cp_size=1"]), 2)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state()
    GradientState._reset_state()
    world = start(r)
    try:
        assert capsys.readouterr().out.count("parallelism.fsdp=true on one process: nothing to shard") == 1
        assert (world.world_size, world.fsdp, world.shard_on_cpu) == (1, False, False)
        model, _ = world.prepare(torch.nn.Linear(4, 4), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # not FSDP2's DTensor shards
    finally:
        world.close()
        AcceleratorState._reset_state()
        GradientState._reset_state()


def test_cli_print_and_error_exit_codes(capsys, tmp_path):
    from longdoc.cli import main

    rec = tmp_path / "r.yaml"
    rec.write_text("data: {path: random}\ntrain: {steps: 2}\n")
    assert main(["train", str(rec), "parallelism.cp_size=2", "--print"]) == 0
    assert "cp_size: 2" in capsys.readouterr().out
    assert main(["train", str(rec), "train.stepz=3"], catch=True) == 2  # as on the command line
    assert "did you mean train.steps" in capsys.readouterr().err


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_fits_the_launch_its_header_names(path):
    """The accelerate config named in the header gives a world the recipe's cp_size and batch fit."""
    import re

    import yaml

    header = path.read_text().split("\n\n", 1)[0]
    launch = re.search(r"--config_file (\S+)", header)
    assert launch, f"{path.name}: the header must show an `accelerate launch --config_file ...` command"
    cfg = yaml.safe_load((path.parents[1] / launch.group(1)).read_text())
    recipe = load_recipe(path)
    cuda = "cpu" not in launch.group(1)
    assert recipe.parallelism.fsdp == cuda  # GPU recipes shard with FSDP2; the CPU demo replicates (DDP)
    check_launch(recipe, int(cfg["num_processes"]), cuda=cuda)
    assert f"recipes/{path.name}" in header


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_sequences_fit_the_extended_context(path):
    from longdoc import models
    from longdoc.train.modeling import rope_parameters

    recipe = load_recipe(path)
    if recipe.model.name != models.DEFAULT_MODEL:
        pytest.skip("hub model: its config is not available offline")
    config = models.load_config(recipe.model.name)
    limit = config.max_position_embeddings
    if recipe.model.rope_type:
        params, limit = rope_parameters(config, recipe.model)
        assert params["rope_type"] == recipe.model.rope_type and params["factor"] == recipe.model.rope_factor
    assert recipe.data.seq_len <= limit


@pytest.mark.parametrize("value, want", [("true", True), ("false", False), ("auto", "auto"), ("yes", True)])
def test_resume_takes_yaml_booleans_and_auto(value, want):
    assert recipe_from_dict({"data": {"path": "random"}}, [f"resume={value}"]).resume == want
    assert recipe_from_dict({"data": {"path": "random"}, "resume": want}).resume == want


def test_resume_refuses_other_values_and_overwrite():
    with pytest.raises(RecipeError, match=r"^resume: must be true, false or 'auto', got 'maybe'$"):
        recipe_from_dict({"data": {"path": "random"}}, ["resume=maybe"])
    with pytest.raises(RecipeError, match="resume: must be true, false or 'auto', got 1"):
        recipe_from_dict({"data": {"path": "random"}, "resume": 1})
    with pytest.raises(RecipeError, match="overwrite: cannot be combined with resume=auto"):
        recipe_from_dict({"data": {"path": "random"}}, ["resume=auto", "overwrite=true"])
