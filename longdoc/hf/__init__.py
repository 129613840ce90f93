"""transformers integration: patch a causal LM for exact context parallelism, shard batches, prefill.

Importing this package imports transformers; `import longdoc` alone does not.
"""

from longdoc.hf.attention import UnsupportedFeatureError
from longdoc.hf.batch import shard_batch, shift_labels
from longdoc.hf.patch import CPInputError, is_patched, patch, unpatch

__all__ = ["CPInputError", "CPTrainer", "CPTrainerMixin", "UnsupportedFeatureError", "is_patched", "patch",
           "shard_batch", "shift_labels", "unpatch"]


def __getattr__(name: str):
    # CPTrainer pulls in transformers.Trainer (and accelerate): only when asked for.
    if name in ("CPTrainer", "CPTrainerMixin"):
        from longdoc.hf import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'longdoc.hf' has no attribute {name!r}")
