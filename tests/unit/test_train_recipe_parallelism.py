"""The recipe's `parallelism:` section: every context-parallel setting in one place, each old key refused in one
line that names its new key (in a recipe file, as an override, on the command line), and no shipped recipe,
guide or example spelling an old one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from longdoc.train.config import RecipeError, load_recipe, recipe_from_dict
from longdoc.train.moved_keys import MOVED

ROOT = Path(__file__).parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# a value each key takes, together a valid section (usp 1 x 2 at cp 2, offload with the default checkpointing)
VALUES = {"cp_size": 2, "ulysses_size": 2, "strategy": "usp", "layout": "contiguous", "fsdp": True,
          "offload_checkpoints": True, "tiled_mlp": True, "mlp_tile_tokens": 64}


def _nested(dotted: str, value) -> dict:
    section, _, name = dotted.rpartition(".")
    return {section: {name: value}} if section else {name: value}


def _moved(old: str) -> str:
    return rf"^`{re.escape(old)}` moved: use `{re.escape(MOVED[old])}`$"


def test_the_section_holds_every_moved_key():
    assert sorted(new.removeprefix("parallelism.") for new in MOVED.values()) == sorted(VALUES)
    r = recipe_from_dict({"data": {"path": "random"}}, [f"parallelism.{k}={v}" for k, v in VALUES.items()])
    assert {k: getattr(r.parallelism, k) for k in VALUES} == VALUES
    assert {k.removeprefix("parallelism."): v for k, v in r.flat().items() if k.startswith("parallelism.")} == VALUES


@pytest.mark.parametrize("old", MOVED)
def test_an_old_key_in_a_recipe_names_its_new_key(old):
    with pytest.raises(RecipeError, match=_moved(old)):
        recipe_from_dict({"data": {"path": "random"}, **_nested(old, VALUES[old.rpartition(".")[2]])})


@pytest.mark.parametrize("old", MOVED)
def test_an_old_key_as_an_override_names_its_new_key(old):
    with pytest.raises(RecipeError, match=_moved(old)):
        recipe_from_dict({"data": {"path": "random"}}, [f"{old}={VALUES[old.rpartition('.')[2]]}"])


def test_the_command_line_refuses_an_old_key_in_the_parent_in_one_line(capsys, tmp_path):
    from longdoc.cli import main

    old = tmp_path / "old.yaml"
    old.write_text("data: {path: random}\ntrain: {steps: 2, strategy: ring}\n")
    assert main(["train", str(old), "--print"], catch=True) == 2
    assert capsys.readouterr().err.strip() == "longdoc train: error: `train.strategy` moved: use `parallelism.strategy`"
    new = tmp_path / "new.yaml"
    new.write_text("data: {path: random}\nparallelism: {cp_size: 2}\n")
    assert main(["train", str(new), "cp_size=1", "--print"], catch=True) == 2
    assert capsys.readouterr().err.strip() == "longdoc train: error: `cp_size` moved: use `parallelism.cp_size`"
    assert main(["train", str(new), "parallelism.cp_size=1", "--print"]) == 0
    assert "parallelism:\n  cp_size: 1\n" in capsys.readouterr().out


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_set_parallelism_in_its_section_only(path):
    tree = yaml.safe_load(path.read_text())
    for old in MOVED:
        section, _, name = old.rpartition(".")
        assert name not in ((tree.get(section) or {}) if section else tree), f"{path.name}: {old}"
    assert load_recipe(path).parallelism.cp_size == tree["parallelism"]["cp_size"]


# an old override or key spelled in a command, a comment or a guide; CPTrainer and ContextParallel keep their
# Python keyword arguments (cp_size=, ulysses_size=)
OLD_SPELLING = re.compile(r"(?<![\w.])(cp_size|ulysses_size)=\d|\btrain\.(" + "|".join(
    old.partition(".")[2] for old in MOVED if old.startswith("train.")) + r")\b")
DOCUMENTED = ["README.md", "Makefile", "docs/**/*.md", "docs/**/*.sh", "recipes/**/*.yaml", "examples/**/*"]


def test_no_guide_recipe_or_example_spells_an_old_key():
    files = {p for pattern in DOCUMENTED for p in ROOT.glob(pattern) if p.is_file()}
    files.discard(ROOT / "docs" / "changelog.md")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sorted(files)
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if OLD_SPELLING.search(line) and not re.search(r"CPTrainer|ContextParallel|cp_strategy|cp_size=a\.", line)]
    assert not found, "\n".join(found)
