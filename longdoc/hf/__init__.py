"""transformers integration: patch a causal LM for exact context parallelism, shard batches, prefill.

Importing this package imports transformers; `import longdoc` alone does not.
"""

from longdoc.hf.attention import UnsupportedFeatureError
from longdoc.hf.batch import shard_batch, shift_labels
from longdoc.hf.patch import CPInputError, is_patched, patch, unpatch

__all__ = ["CPInputError", "UnsupportedFeatureError", "is_patched", "patch", "shard_batch", "shift_labels", "unpatch"]
