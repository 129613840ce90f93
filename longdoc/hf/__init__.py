"""transformers integration: patch a causal LM for exact context parallelism, shard batches, prefill, decode.

Importing this package imports transformers; `import longdoc` alone does not.

    modelinfo.py  the model behind a wrapper, its name, config features refused by name, RoPE limits
    attention.py  the "longdoc_cp" backend: the one registration, per-call checks, dispatch by mode
    patch.py      patch / unpatch: the backend, the CP loss share, per-call input checks, model.generate
    session.py    KVSession and generate(): CP prefill, extend, rollback, greedy or seeded sampling
    decode.py     the decode mathematics: sharded KV cache, extend attention, token choice
    prefill.py    evaluation forwards without a cache: logits / log-probs at chosen positions
    verify.py     `longdoc verify`
    trainer.py    CPTrainer / CPTrainerMixin: transformers.Trainer (and TRL's SFTTrainer) under CP
    dpo_trainer.py  CPDPOTrainerMixin: TRL's DPOTrainer under CP
"""

from typing import TYPE_CHECKING, Any

from longdoc.hf.modelinfo import UnsupportedFeatureError
from longdoc.hf.patch import chunked_loss, is_patched, patch, unpatch
from longdoc.hf.session import Generation, KVSession, generate
from longdoc.parallel.batch import CPInputError, shard_batch, shift_labels

if TYPE_CHECKING:  # type checkers see the classes; at run time __getattr__ imports transformers.Trainer lazily
    from longdoc.hf.dpo_trainer import CPDPOTrainerMixin
    from longdoc.hf.trainer import CPTrainer, CPTrainerMixin

__all__ = ["CPDPOTrainerMixin", "CPInputError", "CPTrainer", "CPTrainerMixin", "Generation", "KVSession",
           "UnsupportedFeatureError", "chunked_loss", "generate", "is_patched", "patch", "shard_batch", "shift_labels",
           "unpatch"]


def __getattr__(name: str) -> Any:
    # CPTrainer pulls in transformers.Trainer (and accelerate): only when asked for.
    if name in ("CPTrainer", "CPTrainerMixin"):
        from longdoc.hf import trainer

        return getattr(trainer, name)
    if name == "CPDPOTrainerMixin":
        from longdoc.hf import dpo_trainer

        return dpo_trainer.CPDPOTrainerMixin
    raise AttributeError(f"module 'longdoc.hf' has no attribute {name!r}")
