"""Recipe keys that moved, and the one-line error that names where each went.

The context-parallel settings live in one `parallelism:` section (0.3.0). A recipe or a `key=value` override
that still uses an old key is refused with its new name, never silently ignored: an ignored `cp_size: 8` would
train at cp 1 until memory ran out.
"""

from __future__ import annotations

from typing import Any

from longdoc.train.recipe_parse import RecipeError

# old dotted key -> new dotted key
MOVED: dict[str, str] = {
    "cp_size": "parallelism.cp_size",
    "ulysses_size": "parallelism.ulysses_size",
    "train.strategy": "parallelism.strategy",
    "train.layout": "parallelism.layout",
    "train.fsdp": "parallelism.fsdp",
    "train.offload_checkpoints": "parallelism.offload_checkpoints",
    "train.tiled_mlp": "parallelism.tiled_mlp",
    "train.mlp_tile_tokens": "parallelism.mlp_tile_tokens",
}


def check_moved(tree: dict[str, Any]) -> None:
    """Raise RecipeError naming the new key for the first old key in `tree` (a recipe after its overrides)."""
    for old, new in MOVED.items():
        section, _, name = old.rpartition(".")
        node = tree.get(section) if section else tree
        if isinstance(node, dict) and name in node:
            raise RecipeError(f"`{old}` moved: use `{new}`")
