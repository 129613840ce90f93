"""longdoc: exact context-parallel fine-tuning of Hugging Face causal LMs on very long documents.

    import longdoc
    cp = longdoc.ContextParallel(group=None, layout="zigzag")
    out = longdoc.attention(q, k, v, cp, causal=True)
    model = longdoc.patch(model, cp); local = cp.shard_batch(batch); model(**local).loss.backward()
"""

from typing import TYPE_CHECKING, Any

from longdoc.parallel.api import ContextParallel, attention

if TYPE_CHECKING:  # type checkers see the real signature; at run time __getattr__ imports it on first use
    from longdoc.hf.patch import patch

__all__ = ["ContextParallel", "attention", "patch"]
__version__ = "0.3.0.dev0"  # the one place the version is written (pyproject reads it)


def __getattr__(name: str) -> Any:
    # transformers is heavy and optional for the CP core: import the HF layer on first use only.
    if name == "patch":
        from longdoc.hf.patch import patch

        return patch
    if name == "models":
        import longdoc.models as models

        return models
    raise AttributeError(f"module 'longdoc' has no attribute {name!r}")
