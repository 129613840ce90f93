"""`CPTrainer`: transformers.Trainer with exact context parallelism; `CPTrainerMixin` for TRL and other subclasses.

    # my_script.py: trainer = longdoc.hf.CPTrainer(model=..., args=TrainingArguments(...), train_dataset=...,
    #                                               cp_size=2); trainer.train()
    torchrun --nproc_per_node 2 my_script.py
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml my_script.py

What the Trainer does differently under CP, and why each piece keeps the run equal to one process:
  - World = dp x cp. The ranks r = dp_index * cp + cp_index form a DeviceMesh ("dp", "cp"); the model
    is patched over the "cp" group (longdoc.patch).
  - Data: Accelerate's per-process sharding of the dataloaders is narrowed to the dp replicas, so every
    rank of a CP group reads the same batches (with dp=1: exactly the batches of one process, same order).
  - Loss: each full batch goes through cp.shard_batch; a rank's loss is its SHARE, sum(its token losses) /
    N. With `average_tokens_across_devices` (the default) N counts the loss tokens of the whole optimizer
    step (every micro-batch and replica) and the share is multiplied by the world size, because DDP/FSDP
    average gradients over all dp x cp ranks. Without it N is the replica's own count and the factor is cp,
    which reproduces plain DDP's mean of per-replica means. Either way the logged loss and grad_norm are
    those of one process on the same global batch.
  - Evaluation: each batch's loss is the full-batch mean (shares summed over the CP group); metrics are
    gathered once per CP group, so eval_loss equals one process.
  - Process groups: one per stream (longdoc.parallel.groups): CP traffic on its own group, DDP's gradient
    buckets moved by a comm hook onto a group of their own, the replicas' token count on the dp group; the
    world group stays to Trainer/Accelerate. `cp_debug_collectives=True` (or LONGDOC_DEBUG_COLLECTIVES=1)
    checks every collective CPTrainer issues across its group first (longdoc.parallel.guard).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from longdoc.hf.patch import chunked_loss, patch
from longdoc.parallel import comm
from longdoc.parallel import strategy as registry
from longdoc.parallel.api import ContextParallel, check_strategy
from longdoc.parallel.batch import count_loss_tokens, shard_batch, source_index
from longdoc.parallel.groups import Groups, make_groups, reduce_gradients_on
from longdoc.parallel.guard import GradCoverage, debug_collectives_from_env
from longdoc.parallel.layout import check_layout

__all__ = ["CPTrainer", "CPTrainerMixin", "cp_mesh"]

# What shard_batch takes: plain, right/left-padded and packed rows (DataCollatorWithFlattening, TRL padding-free).
_BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
               "max_length_q", "max_length_k", "seq_idx")
# Keys collators add that carry no information shard_batch needs (they are recomputed or unused).
_DROPPED_KEYS = ("use_cache", "num_items_in_batch")


def _launched_world_size() -> int:
    from longdoc.runtime.launch import launched_world

    return launched_world().world_size


def check_ulysses_size(strategy: str, ulysses_size: int | None, cp_size: int) -> None:
    """cp_ulysses_size goes with cp_strategy="usp" and divides cp_size (checked before anything joins)."""
    divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
    factored = registry.get(strategy).factored
    if factored and ulysses_size is None:
        raise ValueError(f"CPTrainer: cp_strategy={strategy!r} factors cp_size={cp_size} as ring x Ulysses; pass "
                         f"cp_ulysses_size, one of {divisors}")
    if ulysses_size is not None and not factored:
        usable = " or ".join(f"cp_strategy={n!r}" for n in registry.names() if registry.get(n).factored)
        raise ValueError(f"CPTrainer: cp_ulysses_size only applies to {usable} (got {strategy!r})")
    if ulysses_size is not None and ulysses_size not in divisors:
        raise ValueError(f"CPTrainer: cp_ulysses_size must be a divisor of cp_size={cp_size} ({divisors}), got "
                         f"{ulysses_size!r}")


def check_cp_size(cp_size: int, world_size: int) -> int:
    """The number of data-parallel replicas, or a ValueError naming the fix. Pure: the same on every rank."""
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"CPTrainer: cp_size must be a positive integer, got {cp_size!r}")
    if world_size < cp_size:
        raise ValueError(
            f"CPTrainer: cp_size={cp_size} needs at least {cp_size} processes, but this run has {world_size}. "
            f"Launch with `torchrun --nproc_per_node {cp_size} SCRIPT` or `accelerate launch --config_file "
            f"recipes/accelerate/cpu-2proc.yaml SCRIPT` (on CPU, not `--cpu`: that starts one process), "
            f"or set cp_size=1")
    if world_size % cp_size:
        raise ValueError(f"CPTrainer: cp_size={cp_size} must divide the number of processes ({world_size}); "
                         f"use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return world_size // cp_size


def _check_joined(training_args) -> None:
    """Refuse a launch whose ranks TrainingArguments left unjoined (a CPU trap that looks like success)."""
    launched = _launched_world_size()
    if training_args.world_size != launched:
        raise ValueError(
            f"CPTrainer: the launcher started {launched} processes but TrainingArguments joined "
            f"{training_args.world_size}; on a machine without CUDA pass TrainingArguments(use_cpu=True, ...) so "
            f"the ranks form one gloo group (otherwise each would train alone, without context parallelism)")


def _groups(cp_size: int, device_type: str, timeout: datetime.timedelta | None = None, debug: bool = False,
            fsdp: bool = False) -> Groups:
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return make_groups(world // cp_size, cp_size, device_type, timeout, debug_collectives=debug, fsdp=fsdp)


def cp_mesh(cp_size: int, device_type: str, timeout: datetime.timedelta | None = None):
    """(mesh, cp_group, dp_group) for the initialized world: a DeviceMesh with axes ("dp", "cp"), CP groups
    made of consecutive ranks, each group used by no other stream (longdoc.parallel.groups). (None, None,
    None) on one process."""
    g = _groups(cp_size, device_type, timeout)
    return g.mesh, g.cp, g.dp


class CPTrainerMixin:
    """Context parallelism for a transformers.Trainer subclass: `class T(CPTrainerMixin, SomeTrainer)`.

    Extra constructor arguments (everything else goes to the Trainer unchanged):
        cp_size: ranks per context-parallel group; it must divide the launched world size.
        cp_layout: "zigzag" (balanced causal work, default) or "contiguous".
        cp_strategy: "ring" (default), "allgather", "ulysses" or "usp" (longdoc.attention explains them).
        cp_ulysses_size: with cp_strategy="usp", ranks per Ulysses group (a divisor of cp_size).
        cp_timeout: seconds any CP communication may wait (default: the process group's timeout).
        cp_debug_collectives: check every collective CPTrainer issues (sequence number, op tag, bytes) across
            its group first, and that every trainable parameter gets a gradient in every backward; None
            (default) reads LONGDOC_DEBUG_COLLECTIVES.
        cp_loss_chunk_tokens: the loss runs from the decoder's hidden states over this many loss tokens at a
            time (longdoc.hf.chunked_loss), so a rank never holds (local tokens x vocabulary) logits; None
            (default) sizes the chunk from the vocabulary, 0 computes the model's own full logits. Evaluation
            with compute_metrics (which needs the logits) always computes them.
    """

    def __init__(self, *args: Any, cp_size: int = 1, cp_layout: str = "zigzag", cp_strategy: str = "ring",
                 cp_ulysses_size: int | None = None, cp_timeout: float | None = None,
                 cp_debug_collectives: bool | None = None, cp_loss_chunk_tokens: int | None = None,
                 **kwargs: Any) -> None:
        # Every check that can fail runs before the Trainer joins the process group: one error on every rank.
        self.cp_dp_size = check_cp_size(cp_size, _launched_world_size())
        check_layout(cp_layout)
        check_strategy(cp_strategy)
        check_ulysses_size(cp_strategy, cp_ulysses_size, cp_size)
        if cp_loss_chunk_tokens is not None and (not isinstance(cp_loss_chunk_tokens, int) or cp_loss_chunk_tokens < 0):
            raise ValueError(f"cp_loss_chunk_tokens must be None (sized from the vocabulary), 0 (full logits) or a "
                             f"positive number of tokens, got {cp_loss_chunk_tokens!r}")
        self._cp_loss_chunk = cp_loss_chunk_tokens
        if type(self).compute_loss is CPTrainerMixin.compute_loss and any(
                c.__name__ == "DPOTrainer" and c.__module__.startswith("trl.") for c in type(self).__mro__):
            raise TypeError("CPTrainerMixin computes a causal-LM loss; for trl.DPOTrainer use longdoc.hf."
                            "CPDPOTrainerMixin (class T(CPDPOTrainerMixin, DPOTrainer))")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self._refuse_unsupported(training_args, kwargs)
        if training_args is not None:
            _check_joined(training_args)
        super().__init__(*args, **kwargs)
        _check_joined(self.args)
        self.loss_is_scaled_for_ga: bool | None = True  # compute_loss divides by the whole step's token count itself
        timeout = datetime.timedelta(seconds=cp_timeout) if cp_timeout is not None else None
        debug = debug_collectives_from_env() if cp_debug_collectives is None else bool(cp_debug_collectives)
        self._cp_groups = _groups(cp_size, self.args.device.type, timeout, debug, fsdp=bool(self.is_fsdp_enabled))
        self.cp_mesh, self._dp_group = self._cp_groups.mesh, self._cp_groups.dp
        self.cp = ContextParallel(self._cp_groups.cp, layout=cp_layout, timeout=timeout, debug_collectives=debug,
                                 ulysses_size=cp_ulysses_size)
        self._cp_debug = debug
        self._cp_wrapped = None  # the DDP model whose gradient buckets were moved to their own group
        self._cp_coverage: GradCoverage | None = None
        self.cp_dp_rank = self.cp_mesh.get_local_rank("dp") if self.cp_mesh is not None else 0
        patch(self.model, self.cp, strategy=cp_strategy)
        pad = getattr(self.processing_class, "pad_token_id", None)
        self._cp_pad_id = int(pad) if isinstance(pad, int) and pad >= 0 else 0
        # TRL's SFTTrainer logs entropy, mean_token_accuracy and num_tokens from its own compute_loss, which this
        # class replaces: they are computed here instead, over the CP group (see _log_sft_metrics)
        self._cp_sft = any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl.") for c in type(self).__mro__)

    @staticmethod
    def _refuse_unsupported(training_args, kwargs: dict) -> None:
        if training_args is None:
            return
        if getattr(training_args, "label_smoothing_factor", 0.0):
            raise ValueError("CPTrainer: label_smoothing_factor is not supported under CP (the smoother needs the "
                             "full logits of every token on one rank); set label_smoothing_factor=0")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("CPTrainer: compute_loss_func is not supported under CP (it would see only this rank's "
                             "logits); the loss is the model's causal-LM loss, summed over the CP group")

    # ---- data: one stream per data-parallel replica ----

    def _per_replica(self, loader):
        """Narrow Accelerate's per-process sharding to per-replica: all CP ranks of a group read the same."""
        if self.cp_mesh is None:
            return loader
        from accelerate.data_loader import BatchSamplerShard

        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, BatchSamplerShard):
            raise ValueError(
                f"CPTrainer needs a map-style dataset (with __len__) read through Accelerate's sharded batch sampler, "
                f"got a {type(loader).__name__}; an IterableDataset or dispatch_batches=True splits each batch over "
                f"all ranks, so the CP ranks of a group would read different data. Use a datasets.Dataset or a list")
        sampler.num_processes = self.cp_dp_size  # read lazily by __iter__ and __len__
        sampler.process_index = self.cp_dp_rank
        if self.cp_dp_size == 1:
            # One replica: the batches of one process, so no last batch completed with wrapped-around samples
            sampler.even_batches = False
        return loader

    def get_train_dataloader(self):
        return self._per_replica(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._per_replica(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._per_replica(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.cp_dp_size

    # ---- loss ----

    def _full_batch(self, inputs: dict) -> dict:
        """The batch keys shard_batch takes, after refusing what CP cannot run exactly (before any communication)."""
        extra = sorted(k for k, v in inputs.items() if k not in _BATCH_KEYS + _DROPPED_KEYS and v is not None)
        if extra:
            raise ValueError(f"CPTrainer: the batch holds {extra}, which context parallelism cannot shard; the "
                             f"collator may return {', '.join(_BATCH_KEYS)} (set remove_unused_columns=True or drop "
                             f"them in the collator)")
        # packed rows (position_ids restarting per document) go to shard_batch, which masks the documents
        batch = {k: inputs[k] for k in _BATCH_KEYS if inputs.get(k) is not None}
        if "labels" not in batch:
            raise ValueError("CPTrainer: the batch has no labels; under CP the loss needs them (a causal-LM collator, "
                             "e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False), adds them)")
        return batch

    @staticmethod
    def _count_loss_tokens(batch: dict) -> torch.Tensor:
        # The same targets cp.shard_batch takes: shifted over the full row (or each packed document),
        # padding never counts.
        return torch.tensor(count_loss_tokens(batch))

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Loss tokens of the optimizer step on this replica, summed over the replicas when averaging tokens.

        Trainer's own count gathers over every rank, which counts each CP group's batch cp times."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        n = sum(self._count_loss_tokens(self._full_batch(b)) for b in batch_samples).to(device)
        # (evaluation ignores the count: each batch's loss is its own mean, as on one process)
        if (self.args.average_tokens_across_devices and self._dp_group is not None and self.cp_dp_size > 1
                and self.model.training):
            n = comm.all_reduce(n.clone(), self._dp_group, self.cp.timeout, self._cp_groups.guard("dp"),
                                "all_reduce loss tokens")
        return n

    def _loss_scale(self) -> int:
        """DDP/FSDP average gradients over dp x cp ranks; this factor turns that into the right sum."""
        if self.args.average_tokens_across_devices:
            return self.cp_dp_size * self.cp.size  # shares of the whole global step: their sum is the mean
        return self.cp.size  # shares of the replica's batch: DDP's average over replicas remains

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's loss share under CP (training), or the full batch loss (evaluation)."""
        batch = self._full_batch(inputs)
        training = model.training
        seq_len = batch["input_ids"].shape[1]
        count = None
        if training:
            count = num_items_in_batch
            if count is None:  # called outside Trainer's step: this micro-batch is the whole step
                count = self._get_num_items_in_batch([batch], batch["input_ids"].device)
            count = torch.as_tensor(count).clamp_min(1)  # a step with no loss token: loss 0, never NaN
        local = shard_batch(batch, self.cp, pad_token_id=self._cp_pad_id, num_items_in_batch=count)
        # the loss from hidden states, a chunk of tokens at a time, unless the caller wants the logits themselves
        chunked = self._cp_loss_chunk != 0 and not (return_outputs and not self.args.prediction_loss_only)
        stats: dict | None = {} if chunked and self._cp_sft else None
        with chunked_loss(self.model, self._cp_loss_chunk, stats) if chunked else contextlib.nullcontext():
            outputs = model(**local, use_cache=False)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if self._cp_sft:
            self._log_sft_metrics(None if chunked else outputs.get("logits") if isinstance(outputs, dict) else None,
                                  local["shift_labels"], inputs, training, stats)
        if training:
            loss = loss * self._loss_scale()
        elif self.cp.size > 1:
            # the shares of one batch sum to its mean loss
            loss = comm.all_reduce(loss.detach().clone(), self.cp.group, self.cp.timeout, self.cp.guard,
                                   "all_reduce eval loss")
        if not return_outputs:
            return loss
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        if logits is not None and self.cp.size > 1:
            # compute_metrics expects the logits of the full batch, in token order, without CP padding;
            # shard_batch may have rolled (left padding) or laid out per document (packing) the tokens
            where = self.cp.gather(source_index(batch, self.cp), dim=1)  # (batch, padded) full-row column
            gathered = self.cp.gather(logits.detach(), dim=1)
            full = gathered.new_zeros(gathered.shape[0], seq_len, gathered.shape[2])
            rows, cols = torch.nonzero(where >= 0, as_tuple=True)
            full[rows, where[rows, cols]] = gathered[rows, cols]
            outputs["logits"] = full
        return loss, outputs

    def floating_point_ops(self, inputs: dict) -> int:
        """Trainer sums every rank's count into total_flos, and every CP rank holds its group's full batch: only
        CP rank 0 counts it, so total_flos is one process's (or plain DDP's over the replicas)."""
        return super().floating_point_ops(inputs) if self.cp.rank == 0 else 0

    @torch.no_grad()
    def _log_sft_metrics(self, logits: torch.Tensor | None, shift_labels: torch.Tensor, inputs: dict,
                         training: bool, stats: dict | None = None) -> None:
        """TRL SFTTrainer's entropy, mean_token_accuracy and num_tokens, exactly as one process computes them over
        the global micro-batch: this rank's sums over its tokens are summed over the CP group and the replicas;
        num_tokens counts each replica's batch once (every CP rank of a group holds all of it)."""
        if stats is not None:  # the chunked loss's per-chunk (tokens, entropy, correct) sums
            device = shift_labels.device
            sums = torch.stack(list(stats.values())).sum(0).to(device) if stats else torch.zeros(3, dtype=torch.float64,
                                                                                                 device=device)
        elif logits is None:
            return
        else:
            mask = shift_labels != -100
            logp = torch.log_softmax(logits.float(), dim=-1)  # (batch, local_len, vocab)
            entropy = -(logp.exp() * logp).sum(dim=-1)
            correct = (logits.argmax(dim=-1) == shift_labels) & mask  # argmax: the first of tied maxima, as TRL's
            sums = torch.stack([mask.sum(), entropy[mask].sum(), correct.sum()]).double()
        if self.cp.size > 1:  # main thread, same point of every rank's step: the cp stream's order holds
            sums = comm.all_reduce(sums, self.cp.group, self.cp.timeout, self.cp.guard, "all_reduce sft metrics")
        if "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        else:  # padding-free rows: TRL counts the row's positions
            tokens = torch.tensor(inputs["position_ids"].shape[1])
        sums = torch.cat([sums, tokens.to(sums).reshape(1)])
        if self._dp_group is not None and self.cp_dp_size > 1:
            state = self.accelerator.gradient_state
            if not training and state.end_of_dataloader and 0 < state.remainder <= self.cp_dp_rank:
                sums.zero_()  # a repeated sample that completes the last eval batch: TRL's gather_for_metrics drops it
            sums = comm.all_reduce(sums, self._dp_group, self.cp.timeout, self._cp_groups.guard("dp"),
                                   "all_reduce sft metrics")
        valid, entropy_sum, num_correct, num_tokens = sums.tolist()
        mode = "train" if training else "eval"
        self._metrics[mode]["entropy"].append(entropy_sum / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(num_correct / valid if valid > 0 else 0.0)
        if training:
            self._total_train_tokens += int(num_tokens)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    # ---- gradients: DDP's buckets on their own group ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        if model is not self._cp_wrapped:  # the first step of a train() call: Trainer has wrapped it by now
            self._cp_wrapped = model
            reduce_gradients_on(model, self._cp_groups.grads, self._cp_groups.guard("grads"))
            if self._cp_debug and self.cp_mesh is not None and not self.is_fsdp_enabled:
                if self._cp_coverage is not None:
                    self._cp_coverage.remove()
                self._cp_coverage = GradCoverage(model.named_parameters())
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._cp_coverage is not None:  # before this rank issues anything else
            self._cp_coverage.check(f"CPTrainer step {self.state.global_step + 1}")
        return loss

    # ---- evaluation: metrics once per CP group ----

    def _gather_per_group(self, data, use_gather_object: bool = False):
        """gather_for_metrics over the dp replicas only: every CP rank of a group holds the same values."""
        acc = self.accelerator
        if self.cp.size == 1:
            return acc.gather_for_metrics(data, use_gather_object=use_gather_object)
        if use_gather_object:
            raise ValueError("CPTrainer: eval_use_gather_object=True is not supported under CP; gather tensors")
        from accelerate.utils import recursively_apply

        def first_of_group(t: torch.Tensor) -> torch.Tensor:
            t = acc.gather(t)  # (world * n, ...), ranks in order: rank = dp_index * cp + cp_index
            return t.reshape(self.cp_dp_size, self.cp.size, -1, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])

        out = recursively_apply(first_of_group, data)
        state = acc.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch's padding to equal batches
            out = recursively_apply(lambda t: t[: state.remainder], out)
        return out

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        self.gather_function = self._gather_per_group  # Trainer resets it to gather_for_metrics at the end
        return super().evaluation_loop(*args, **kwargs)


class CPTrainer(CPTrainerMixin, Trainer):
    """A drop-in transformers.Trainer with exact context parallelism: the same constructor plus `cp_size`
    (and optionally cp_layout, cp_strategy, cp_ulysses_size, cp_timeout); see CPTrainerMixin and the module
    docstring."""
