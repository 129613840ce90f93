"""Chunked causal-LM loss: the (tokens x vocab) logits are never materialized at once.

At 32k tokens and SmolLM2's 49k vocabulary, full fp32 logits are 6.4 GB per sequence, more than the
whole rest of the step. `LossModel` runs the decoder body to get hidden states, then computes the
cross-entropy over `chunk_tokens` tokens at a time, each chunk under activation checkpointing so
that its logits are freed after the forward and recomputed, one chunk at a time, in the backward.

The value returned is this rank's loss SHARE: sum of its tokens' CE / the global number of loss
tokens of the whole optimizer step (every micro-batch, every data-parallel replica). Weighted rows (a
training mix, longdoc.train.mix) generalise it: sum(w * CE) / sum(w) over the step, plus an optional
sum(k * KL(base || tuned)) / (number of KL tokens of the step) toward the frozen base (LoRA disabled). Summed over all
ranks and micro-batches it is the token-mean loss of the step; its gradients, summed the same way,
are the single-process gradients (see longdoc/train/step.py for how DDP's averaging is undone).
MoE models with a router auxiliary loss add this rank's share of coef x aux (aux of the whole sequence of
the forward, longdoc.hf.router): the step's objective is the token-mean CE plus coef x the mean aux of
its forwards (micro-batches of every replica).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longdoc.hf.head import IGNORE, LogitHead, base_causal_lm, chunked_ce_sum  # noqa: F401  (re-exported)
from longdoc.runtime.budgets import loss_chunk_tokens
from longdoc.train.dpo import DpoBatch, dpo_share


class ChunkStats:
    """Records the largest logits block ever computed (tests assert it stays at the chunk size)."""

    def __init__(self):
        self.max_rows = 0
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1
        self.max_rows = max(self.max_rows, output.reshape(-1, output.shape[-1]).shape[0])


def _chunk_kl(head: LogitHead, h: torch.Tensor, h_base: torch.Tensor, weights: torch.Tensor, base) -> torch.Tensor:
    # sum_t w_t KL(p_base,t || p_tuned,t) over one chunk, both log-softmaxes in fp32. The base logits are
    # recomputed here (also when checkpointing replays this function) from the base's hidden states, so only
    # (chunk, hidden) is kept per chunk, never (chunk, vocab).
    log_q = F.log_softmax(head(h).float(), dim=-1)
    with torch.no_grad(), base():
        log_p = F.log_softmax(head(h_base).float(), dim=-1)
    return (F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * weights).sum()


def chunked_kl_sum(head: LogitHead, hidden: torch.Tensor, base_hidden: torch.Tensor, weights: torch.Tensor,
                   chunk_tokens: int, base) -> torch.Tensor:
    """sum_t weights_t * KL(base || tuned) at every token with weight > 0, `chunk_tokens` at a time; hidden and
    base_hidden (..., hidden_size) are the tuned and the frozen base model's final hidden states of the same
    tokens, `base` a context manager under which the head is the base's (peft's disable_adapter)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    w = weights.reshape(-1).float()
    keep = w > 0
    h, hb, w = hidden[keep], base_hidden.reshape(-1, base_hidden.shape[-1])[keep], w[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    if w.numel() == 0:
        return total + 0.0 * hidden.sum()
    for start in range(0, w.numel(), chunk_tokens):
        part = (h[start:start + chunk_tokens], hb[start:start + chunk_tokens], w[start:start + chunk_tokens])
        if torch.is_grad_enabled() and part[0].requires_grad:
            total = total + checkpoint(_chunk_kl, head, *part, base, use_reentrant=False)
        else:
            total = total + _chunk_kl(head, *part, base)
    return total


class LossModel(nn.Module):
    """A causal LM whose forward returns (loss_share, ce_sum) from a local (CP-sharded) batch.

    This is the module handed to Accelerate (DDP / FSDP2), so the head and the decoder run inside one
    wrapped forward. The causal LM's own forward is called (its CP checks run as hooks on it) with
    `logits_to_keep` = no position, and the decoder's final hidden states are taken from a hook.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None):
        super().__init__()
        self.model = model  # as given (peft-wrapped or not): state dicts keep its key names
        if chunk_tokens is None:  # sized from the vocabulary (longdoc.runtime.budgets)
            head = base_causal_lm(model).get_output_embeddings()
            chunk_tokens = loss_chunk_tokens(head.weight.shape[0] if head is not None else 1)
        self.chunk_tokens = chunk_tokens
        self.aux: torch.Tensor | None = None  # the last call's MoE router auxiliary loss (global), if any
        lm = base_causal_lm(model)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    @property
    def lm(self) -> nn.Module:
        return base_causal_lm(self.model)

    @property
    def head(self) -> LogitHead:
        return LogitHead(self.lm)

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep_logits: bool = False,
               cu_seq_lens: torch.Tensor | None = None, row_lengths: torch.Tensor | None = None,
               branches: torch.Tensor | None = None):
        """(final hidden states (batch, local_len, hidden), logits or None). cu_seq_lens: the packed
        documents' global boundaries of a local batch (cp.shard_batch's cu_seq_lens_q), if any; row_lengths:
        its real row lengths (cp.shard_batch's longdoc_row_lengths), if it has padding; branches: its preference
        pairs (cp.shard_batch's longdoc_branches), if any. The MoE router
        auxiliary loss of the call (the whole sequence's, see longdoc.hf.router), if the model computes one,
        is left in self.aux."""
        from longdoc.parallel.batch import ROW_LENGTHS
        from longdoc.parallel.batch_branches import BRANCHES

        lm = self.lm
        grabbed = {}

        def grab(module, args, output):
            grabbed["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        hook = lm.get_decoder().register_forward_hook(grab)
        try:
            keep = 0 if keep_logits else torch.empty(0, dtype=torch.long, device=input_ids.device)
            extra = {} if cu_seq_lens is None else {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens}
            if row_lengths is not None:
                extra[ROW_LENGTHS] = row_lengths
            if branches is not None:
                extra[BRANCHES] = branches
            out = lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep, **extra)
        finally:
            hook.remove()
        self.aux = getattr(out, "aux_loss", None)
        return grabbed["h"], (out.logits if keep_logits else None)

    def base(self):
        """A context manager under which the model is the frozen base: the LoRA adapters (and peft's
        modules_to_save copies) disabled. The KL term and sigmoid DPO's reference need it; full fine-tuning has no
        frozen base."""
        if not hasattr(self.model, "disable_adapter"):
            raise ValueError("a KL term toward the base model, or the reference of sigmoid DPO, needs LoRA "
                             "(lora.enabled): the base is the model with its adapters disabled")
        return self.model.disable_adapter()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                num_loss_tokens: int | float | torch.Tensor = 1, probe: bool = False,
                cu_seq_lens: torch.Tensor | None = None, row_lengths: torch.Tensor | None = None,
                loss_weights: torch.Tensor | None = None, kl_weights: torch.Tensor | None = None,
                num_kl_tokens: int = 1, aux_weight: float = 0.0, branches: torch.Tensor | None = None,
                dpo: DpoBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """labels: shifted local labels (-100 = no loss). Returns (share, ce_sum): share = ce_sum /
        num_loss_tokens, where ce_sum sums each token's CE times its weight (`loss_weights`, shifted like the
        labels; none = 1) and num_loss_tokens is the sum of the weights over the whole optimizer step;
        with `kl_weights` (shifted, local) the share adds sum_t kl_t * KL_t(base || tuned) / num_kl_tokens
        (the step's number of KL tokens). Every CP rank of a group passes kl_weights or none alike (the frozen
        base's forward runs the CP attention too). The share also adds aux_weight * aux, aux the MoE router
        auxiliary loss of this call (0 for models without one); aux_weight is this rank's share of its
        coefficient (longdoc/train/step.py). With `dpo` (preference rows, longdoc.train.dpo) it returns instead
        (share of the step's preference loss, (4, pairs) policy and reference log-probability sums); `branches`:
        the local batch's longdoc_branches.

        probe=True returns instead (max |model logits - chunked-head logits|, max |model logits|): it runs
        through the wrapped forward, so DDP/FSDP2 gather what they must exactly as in training.
        """
        if probe:
            h, ref = self.hidden(input_ids, position_ids, keep_logits=True)
            ref = ref.float()
            return (ref - self.head(h).float()).abs().max(), ref.abs().max()
        where: dict[str, Any] = {"cu_seq_lens": cu_seq_lens, "row_lengths": row_lengths, "branches": branches}
        h, _ = self.hidden(input_ids, position_ids, **where)
        if dpo is not None:
            return dpo_share(self, h, dpo, lambda: self.hidden(input_ids, position_ids, **where)[0])
        aux = self.aux  # the tuned model's router loss (the base's forward below would overwrite it)
        ce_sum = chunked_ce_sum(self.head, h, labels, self.chunk_tokens, loss_weights)
        n = float(num_loss_tokens)
        # a step with no loss token (or only zero weights) gives a zero share, not NaN
        share = ce_sum / (n if n > 0 else 1.0)
        if kl_weights is not None:
            with torch.no_grad(), self.base():
                h_base, _ = self.hidden(input_ids, position_ids, **where)
            self.aux = aux
            kl_sum = chunked_kl_sum(self.head, h, h_base, kl_weights, self.chunk_tokens, self.base)
            share = share + kl_sum / max(int(num_kl_tokens), 1)
        if aux is not None and aux_weight:
            share = share + aux_weight * aux.to(share.device).float()
        return share, ce_sum


@torch.no_grad()
def check_head(loss_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, name: str = "") -> None:
    """Refuse a model whose logits are not `LogitHead(decoder(x))` (an unknown final transform).

    `loss_model` is a LossModel, possibly wrapped by DDP/FSDP2. Run on a short local batch before
    training; the CP attention inside is a collective, so every rank calls this with the same shapes.
    """
    err, scale = (float(t) for t in loss_model(input_ids, position_ids, probe=True))
    if not err <= 1e-3 * max(1.0, scale):
        raise ValueError(f"{name or 'this model'}: its logits are not lm_head(decoder(x)) (max difference "
                         f"{err:.3g}); the chunked loss would not match the model's own. This architecture's "
                         f"final-logit transform is not supported by longdoc.train yet")
