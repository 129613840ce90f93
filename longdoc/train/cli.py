"""`longdoc train RECIPE.yaml [key=value ...]`.

    longdoc train recipes/cpu-demo.yaml cp_size=1 train.steps=4          # one process
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml
    longdoc train recipes/cpu-demo.yaml --print                          # the effective recipe, then exit
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="fine-tune a causal LM on long documents with context parallelism",
        description="Train from a YAML recipe; key=value arguments override recipe keys (dotted: train.steps=5). "
                    "Run under `accelerate launch` for several processes (see recipes/accelerate/*.yaml).",
    )
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides, e.g. cp_size=2 resume=true data.seq_len=8k (token counts: 8k = 8192)")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the effective recipe and exit")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from longdoc.train.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"longdoc train: {e}", file=sys.stderr)
        return 2
    if args.print_only:
        import yaml

        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    from longdoc.hf import CPInputError, UnsupportedFeatureError
    from longdoc.train.checkpoint import CheckpointError
    from longdoc.train.loop import train

    try:
        result = train(recipe)
    except (RecipeError, CheckpointError, UnsupportedFeatureError, CPInputError) as e:
        # every rank raises the same one (checked before any collective): a message, not a traceback
        print(f"longdoc train: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # train.on_nonfinite=abort, or too many skipped steps
        print(f"longdoc train: stopped: {e}", file=sys.stderr)
        return 1
    from longdoc.train.report import summary

    text = summary(result)
    if text:
        print(text, flush=True)
    return 0
