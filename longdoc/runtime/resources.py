"""Files longdoc reads at run time, found the same way in a source checkout and in an installed wheel.

    resource_dir("synth")     # the synthetic-data templates and vocabularies (checkout: data/synth)
    resource_dir("configs")   # published model configs for `longdoc plan` (checkout: data/configs)
    resource_dir("recipes")   # training recipes and accelerate configs (checkout: recipes)

A checkout (or an editable install) reads the repository's folders, so there is one copy to edit. A wheel carries
copies inside the package, under longdoc/_bundled/ (pyproject.toml's force-include), so `pip install
longdoc-*.whl` works without a checkout. `longdoc recipes --copy DIR` writes the recipes out for editing.
"""

from __future__ import annotations

import argparse
import shutil
from importlib.resources import files
from pathlib import Path
from typing import Literal

Resource = Literal["synth", "configs", "recipes"]
# resource -> its folder in a source checkout (relative to the repository root)
CHECKOUT_PATHS: dict[str, str] = {"synth": "data/synth", "configs": "data/configs", "recipes": "recipes"}
_REPO = Path(__file__).resolve().parents[2]


def resource_dir(name: Resource) -> Path:
    """The folder holding resource `name`: the wheel's bundled copy when installed, else the checkout's.

    Never raises for a missing folder (modules compute their paths at import); the reader of a missing file
    names it and the fix.
    """
    if name not in CHECKOUT_PATHS:
        raise ValueError(f"resource must be one of {', '.join(CHECKOUT_PATHS)}, got {name!r}")
    bundled = Path(str(files("longdoc") / "_bundled" / name))
    return bundled if bundled.is_dir() else _REPO / CHECKOUT_PATHS[name]


def recipe_files() -> list[Path]:
    """Every recipe and accelerate config that ships with longdoc (relative order: recipes, then accelerate/)."""
    root = resource_dir("recipes")
    return sorted(root.rglob("*.yaml"), key=lambda p: (len(p.relative_to(root).parts), str(p)))


def _summary(path: Path) -> str:
    """A recipe's first header comment line (each recipe opens with what it trains and where)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text:
            return text if len(text) <= 72 else text[:71].rstrip() + "…"
    return ""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the recipes that ship with longdoc, or copy them out",
                       description="List the training recipes and accelerate configs that ship with longdoc "
                                   "(the repository's recipes/ folder; an installed wheel carries a copy). "
                                   "`--copy DIR` writes them to DIR/recipes, so the documented commands "
                                   "(`longdoc train recipes/cpu-demo.yaml`, `accelerate launch --config_file "
                                   "recipes/accelerate/cpu-2proc.yaml ...`) run from DIR without a checkout.")
    p.add_argument("--copy", metavar="DIR", help="copy the recipes into DIR/recipes (existing files are kept)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    root = resource_dir("recipes")
    files_ = recipe_files()
    if not files_:
        raise FileNotFoundError(f"no recipes found in {root}; reinstall longdoc or restore the recipes/ folder")
    if args.copy is None:
        print(f"recipes in {root}:")
        for path in files_:
            print(f"  recipes/{path.relative_to(root).as_posix():32s} {_summary(path)}")
        print("copy them out with `longdoc recipes --copy .`")
        return 0
    dest = Path(args.copy).expanduser() / "recipes"
    copied, kept = 0, 0
    for path in files_:
        target = dest / path.relative_to(root)
        if target.exists():
            kept += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied += 1
    print(f"copied {copied} recipe file(s) to {dest}" + (f"; kept {kept} that already existed" if kept else ""))
    return 0
