"""`CPDPOTrainerMixin`: TRL's DPOTrainer with exact context parallelism, `class T(CPDPOTrainerMixin, DPOTrainer)`.

    # my_script.py: trainer = T(model=..., args=DPOConfig(...), train_dataset=..., cp_size=2); trainer.train()
    torchrun --nproc_per_node 2 my_script.py          # examples/dpo_cp.py is a whole script

Everything CPTrainerMixin does (world = dp x cp, dataloaders narrowed to the dp replicas, DDP's buckets on their own
group, evaluation gathered per CP group) holds; the loss is TRL's own. DPOTrainer scores its concatenated batch
(prompt+chosen rows, then prompt+rejected rows, right-padded) through a fused LM head:
`model(input_ids, attention_mask, labels, fused_lm_head=True)` returns per-token log-probs, entropy, mean logits and
top-1 flags of shape (rows, seq_len - 1). Under CP, two hooks on the patched model turn that call into one CP call:
  - before it, the full batch goes through cp.shard_batch; the model runs on this rank's tokens with the targets
    shifted over the full row (TRL's `shift_labels` convention for context parallelism);
  - after it, each per-token field is put back at its global column (zeros elsewhere) and summed over the CP group
    with a differentiable all-reduce (cp.sum), so every rank holds exactly one process's per-token tensors.
TRL's `_compute_loss` then runs unchanged on every CP rank: per-sequence sums, `ld_alpha`, every `loss_type`, WPO
weights, rewards/*, logps/*, logits/*, entropy and mean_token_accuracy are one process's. The policy, the reference
(the adapter-disabled policy, or `ref_model`, patched too) and `precompute_ref_log_probs` all go through the hooks.

The one-process tensors are a few numbers per token (never per vocabulary entry): what grows with the sequence
times the hidden size or the vocabulary stays sharded.

Gradients: cp.sum's backward sums every rank's gradient, so each rank's local tokens get cp x the gradient of the one
(replicated) loss; DDP's average over dp x cp ranks then gives plain DDP's mean over the dp replicas.
Refused by name under CP: the MoE router auxiliary loss (router_aux_loss_coef), vision batches, FSDP with
precomputed reference log-probs, compute_metrics. Written against TRL 1.16.0 (`TESTED_TRL`); another version is refused.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from longdoc.hf.modelinfo import hf_model
from longdoc.hf.patch import patch
from longdoc.hf.trainer import CPTrainerMixin
from longdoc.parallel.batch import ROW_LENGTHS, shard_batch, source_index

__all__ = ["TESTED_TRL", "CPDPOTrainerMixin", "check_trl_version"]

# The TRL releases whose DPOTrainer this module was checked against: the fused LM head's call and output
# (trl.trainer.utils.add_fused_lm_head, FusedCausalLMOutput), `_precompute_ref_logps` and `_tp_size`.
TESTED_TRL = ("1.16.0",)
# The per-token fields of TRL's FusedCausalLMOutput, each (rows, seq_len - 1) in one process
_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# What DPOTrainer passes to the fused forward (anything else is refused before any communication)
_CALL_KEYS = ("input_ids", "attention_mask", "labels", "use_cache", "fused_lm_head")


def check_trl_version(version: str | None = None) -> None:
    """Refuse a TRL release this module was not checked against (the fused head's call and outputs may differ)."""
    if version is None:
        import trl

        version = trl.__version__
    if version not in TESTED_TRL:
        raise RuntimeError(f"CPDPOTrainerMixin was written for TRL {', '.join(TESTED_TRL)} (DPOTrainer's fused LM "
                           f"head), got trl {version}; install trl=={TESTED_TRL[-1]} or check "
                           f"longdoc/hf/dpo_trainer.py against it and add the version to TESTED_TRL")


def _shard_call(cp, pad_id: int, state: dict, module, args: tuple, kwargs: dict):
    """Forward pre-hook: a full fused-head call (TRL's) becomes this rank's CP call; anything else passes."""
    if not kwargs.get("fused_lm_head") or kwargs.get("shift_labels") is not None:
        return None
    extra = sorted(k for k, v in kwargs.items() if k not in _CALL_KEYS and v is not None)
    if args or extra or kwargs.get("labels") is None:
        raise ValueError(f"CPDPOTrainerMixin: a fused-head call with {extra or 'positional arguments or no labels'}, "
                         f"which CP cannot shard; DPOTrainer passes only {', '.join(_CALL_KEYS)}")
    batch = {k: kwargs[k] for k in ("input_ids", "attention_mask", "labels") if kwargs.get(k) is not None}
    local = shard_batch(batch, cp, pad_token_id=pad_id)
    state["call"] = (source_index({k: v for k, v in batch.items() if k != "labels"}, cp), batch["labels"])
    call = {"input_ids": local["input_ids"], "position_ids": local["position_ids"],
            "shift_labels": local["shift_labels"], "num_items_in_batch": local["num_items_in_batch"],
            "use_cache": False, "fused_lm_head": True}
    if ROW_LENGTHS in local:
        call[ROW_LENGTHS] = local[ROW_LENGTHS]
    return (), call


def _full_outputs(cp, state: dict, module, args: tuple, kwargs: dict, output):
    """Forward hook: this rank's per-token fields -> one process's (rows, seq_len - 1) fields on every rank."""
    if "call" not in state:
        return None
    where, labels = state.pop("call")  # where: (rows, local_len) global column of each local token, -1 for padding
    rows, seq_len = labels.shape
    names = [n for n in _FIELDS if getattr(output, n, None) is not None]
    dtype = output.log_probs.dtype
    local = torch.stack([getattr(output, n).to(dtype) for n in names])  # (fields, rows, local_len)
    # column seq_len collects the padding; the scatter is differentiable in `local` (its backward gathers)
    index = torch.where(where >= 0, where, seq_len).expand(len(names), -1, -1)
    full = local.new_zeros(len(names), rows, seq_len + 1).scatter(2, index, local)
    full = cp.sum(full[..., : seq_len - 1])  # disjoint columns per rank: the sum adds zeros, exactly
    fields = dict(zip(names, full.unbind(0)))
    if "is_top1" in fields:
        fields["is_top1"] = fields["is_top1"] > 0.5
    # no loss: the fused head's was this rank's tokens over num_items_in_batch, and DPO reads only per-token fields
    return type(output)(loss=None, label_mask=labels[:, 1:] != -100, aux_loss=None, **fields)


def _attach(model: torch.nn.Module, cp, pad_id: int) -> None:
    """Hooks around the fused head of `model` (already patched), both ahead of longdoc's own per-call checks."""
    hf = hf_model(model)
    state: dict = {}
    hf.register_forward_pre_hook(functools.partial(_shard_call, cp, pad_id, state), prepend=True, with_kwargs=True)
    hf.register_forward_hook(functools.partial(_full_outputs, cp, state), prepend=True, with_kwargs=True)


@contextlib.contextmanager
def _swapped(obj: Any, **attrs: Any):
    """Instance attributes replaced for one call, then restored (or removed, so the class's methods show again)."""
    missing = object()
    saved = {name: obj.__dict__.get(name, missing) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)


class CPDPOTrainerMixin(CPTrainerMixin):
    """Context parallelism for TRL's DPOTrainer: `class CPDPOTrainer(CPDPOTrainerMixin, DPOTrainer)`.

    Takes CPTrainerMixin's arguments (cp_size, cp_layout, cp_strategy, ...); the loss and metrics are TRL's, on one
    process's per-token log-probs (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from trl import DPOTrainer

        check_trl_version()
        if DPOTrainer not in type(self).__mro__:
            raise TypeError(f"CPDPOTrainerMixin goes in front of trl.DPOTrainer: class {type(self).__name__}"
                            f"(CPDPOTrainerMixin, DPOTrainer)")
        strategy = kwargs.get("cp_strategy", "ring")
        self._cp_deferred: list[tuple[str, int]] | None = []  # precomputes asked for before CP joined
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = False  # TRL's loss is the micro-batch mean: Trainer divides by accumulation
        deferred, self._cp_deferred = self._cp_deferred, None
        if self.cp.size > 1:
            self._refuse_under_cp()
            ref = self.ref_model
            if ref is not None:
                ref = self.accelerator.unwrap_model(ref)
                patch(ref, self.cp, strategy=strategy)
            for m in (self.model, ref):
                if m is not None:
                    _attach(m, self.cp, self._cp_pad_id)
            # TRL divides its gathered token count by the ranks that hold the same batch (tensor parallelism);
            # the CP ranks of a group hold the same batch too
            self._tp_size = self._tp_size * self.cp.size
        for name, batch_size in deferred:
            self._precompute_deferred(name, batch_size)

    def _refuse_under_cp(self) -> None:
        if self.aux_loss_enabled:
            raise ValueError("CPDPOTrainerMixin: the MoE router auxiliary loss is not supported under CP (TRL computes "
                             "it from one rank's tokens); set router_aux_loss_coef=0")
        if self._is_vision_dataset:
            raise ValueError("CPDPOTrainerMixin: vision preference batches are not supported under CP; use text rows")
        if self.compute_metrics is not None:
            raise ValueError("CPDPOTrainerMixin: compute_metrics is not supported under CP (TRL recomputes full logits "
                             "for it without the fused head); drop compute_metrics, TRL's own metrics are logged")
        if self.args.precompute_ref_log_probs and self.is_fsdp_enabled:
            raise ValueError("CPDPOTrainerMixin: precompute_ref_log_probs with FSDP is not supported under CP; set "
                             "precompute_ref_log_probs=False (the reference then runs each step)")

    def _precompute_deferred(self, name: str, batch_size: int) -> None:
        if name == "train":
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
        elif name == "eval" and not isinstance(self.eval_dataset, dict):
            self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)
        else:
            self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute, through the CP hooks: deferred until CP has joined (DPOTrainer.__init__ asks first);
        the CP ranks of a group read the same batches and each batch's values are gathered once per group."""
        if self._cp_deferred is not None:
            self._cp_deferred.append((name, batch_size))
            return dataset
        if self.cp.size == 1:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        acc = self.accelerator

        def prepare(*loaders):
            return self._per_replica(type(acc).prepare(acc, *loaders))

        with _swapped(acc, prepare=prepare, gather_for_metrics=self._gather_per_group):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """TRL's DPO loss (the hooks make its forwards CP forwards), not CPTrainerMixin's causal-LM share."""
        return super(CPTrainerMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
