"""Fine-tuning with context parallelism: typed recipes, the Accelerate loop, checkpoints, logging.

    from longdoc.train import load_recipe, train
    result = train(load_recipe("recipes/cpu-demo.yaml", ["train.steps=4"]))

Heavy imports (transformers, accelerate) happen inside `train`, not at import.
"""

from longdoc.train.config import Recipe, RecipeError, load_recipe, recipe_from_dict

__all__ = ["Recipe", "RecipeError", "load_recipe", "recipe_from_dict", "train"]


def __getattr__(name: str):
    if name == "train":
        from longdoc.train.loop import train

        return train
    raise AttributeError(f"module 'longdoc.train' has no attribute {name!r}")
