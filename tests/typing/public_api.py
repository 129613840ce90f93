"""The public API as a user's type checker sees it: `make lint` runs mypy on this file (longdoc ships py.typed).

Never executed: it is a typed program written the way the README and the guides use longdoc, so a signature that
loses its types (an unannotated parameter, a return that becomes Any, a patched model that stops being its own
class) fails `make lint`. tests/unit/test_public_api.py checks that every public callable is annotated.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, Trainer, TrainingArguments
from typing_extensions import assert_type

import longdoc
import longdoc.hf
from longdoc.hf import CPTrainer, CPTrainerMixin, Generation, KVSession, UnsupportedFeatureError
from longdoc.parallel.layout import Packed


def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    cp = longdoc.ContextParallel(layout="zigzag", timeout=60.0)
    assert_type(cp.size, int)
    assert_type(cp.rank, int)
    q_local = assert_type(cp.shard(q, dim=2), torch.Tensor)
    packed = assert_type(cp.pack([5, 11]), Packed)
    assert_type(Packed.from_position_ids(torch.arange(16)), Packed)
    assert_type(cp.positions(16, documents=packed), torch.Tensor)
    out = longdoc.attention(q_local, cp.shard(k, dim=2), cp.shard(v, dim=2), cp, causal=True, window=4096,
                            softcap=None, sinks=None, strategy="allgather")
    assert_type(out, torch.Tensor)
    return assert_type(cp.gather(out, dim=2), torch.Tensor)


def patched(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    cp = longdoc.ContextParallel()
    model = longdoc.patch(model, cp)  # keeps the model's own class
    assert_type(model, LlamaForCausalLM)
    assert_type(longdoc.hf.is_patched(model), bool)
    local = assert_type(cp.shard_batch(batch), dict[str, torch.Tensor])
    assert_type(longdoc.hf.shard_batch(batch, cp, pad_token_id=0), dict[str, torch.Tensor])
    assert_type(longdoc.hf.shift_labels(batch["input_ids"]), torch.Tensor)
    loss = model(**local).loss
    assert loss is not None
    gen = assert_type(longdoc.hf.generate(model, cp, batch["input_ids"], 16, do_sample=True, seed=0), Generation)
    assert_type(gen.tokens, torch.Tensor)
    with KVSession(model, cp) as session:
        logits = assert_type(session.prefill(batch["input_ids"]), torch.Tensor)
        mark = session.mark()
        assert_type(session.greedy(logits, 8), Generation)
        session.rollback(mark)
    assert_type(longdoc.hf.unpatch(model), LlamaForCausalLM)
    return loss


def trainer(model: PreTrainedModel, dataset: torch.utils.data.Dataset) -> None:
    args = TrainingArguments(output_dir="runs/typing", use_cpu=True)
    CPTrainer(model=model, args=args, train_dataset=dataset, cp_size=2, cp_layout="zigzag").train()

    class Mine(CPTrainerMixin, Trainer):  # the mixin form, as with TRL's SFTTrainer
        pass

    try:
        Mine(model=model, args=args, train_dataset=dataset, cp_size=2)
    except UnsupportedFeatureError as e:
        assert_type(str(e), str)
