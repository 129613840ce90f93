"""Chunked causal-LM loss: the (tokens x vocab) logits are never materialized at once.

At 32k tokens and SmolLM2's 49k vocabulary, full fp32 logits are 6.4 GB per sequence, more than the
whole rest of the step. `LossModel` runs the decoder body to get hidden states, then computes the
cross-entropy over `chunk_tokens` tokens at a time, each chunk under activation checkpointing so
that its logits are freed after the forward and recomputed, one chunk at a time, in the backward.

The value returned is this rank's loss SHARE: sum of its tokens' CE / the global number of loss
tokens of the whole optimizer step (every micro-batch, every data-parallel replica). Summed over all
ranks and micro-batches it is the token-mean loss of the step; its gradients, summed the same way,
are the single-process gradients (see longdoc/train/loop.py for how DDP's averaging is undone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM under a peft wrapper (LoRA layers are injected in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class LogitHead:
    """hidden states -> logits exactly as the model's own forward does (lm_head + final transforms).

    A plain object, not a module: lm_head is already registered under the model, and a second
    registration would give the weight two names in every state dict.
    """

    def __init__(self, causal_lm: nn.Module):
        self.proj = causal_lm.get_output_embeddings()
        if self.proj is None:
            raise ValueError(f"{type(causal_lm).__name__} has no output embeddings (lm_head); longdoc trains "
                             f"causal LMs whose forward ends in one")
        cfg = causal_lm.config
        # Gemma-2/3 soft-cap the final logits; Cohere multiplies them by a scale. Both are applied per
        # token, so chunking stays exact. Anything else is caught by `check_head` at start-up.
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        scale = getattr(causal_lm, "logit_scale", None)
        self.scale = float(scale) if isinstance(scale, (int, float)) else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.proj(h)
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ChunkStats:
    """Records the largest logits block ever computed (tests assert it stays at the chunk size)."""

    def __init__(self):
        self.max_rows = 0
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1
        self.max_rows = max(self.max_rows, output.reshape(-1, output.shape[-1]).shape[0])


def _chunk_ce(head: LogitHead, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # (chunk, hidden) -> (chunk, vocab) in fp32 for a stable log-softmax; summed, not averaged, so that
    # the caller controls the normalization across chunks, micro-batches and ranks.
    logits = head(h).float()
    return F.cross_entropy(logits, labels, reduction="sum")


def chunked_ce_sum(head: LogitHead, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Sum of token cross-entropies; hidden (..., hidden_size), labels (...) already shifted, -100 ignored."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    keep = labels != IGNORE
    # Only loss tokens go through the head: padding and masked prompt tokens cost nothing.
    h, y = hidden[keep], labels[keep]  # (n_loss_tokens, hidden), (n_loss_tokens,)
    total = hidden.new_zeros((), dtype=torch.float32)
    if y.numel() == 0:
        # Keep the graph connected so every rank runs the same backward (DDP/FSDP expect it).
        return total + 0.0 * hidden.sum()
    for start in range(0, y.numel(), chunk_tokens):
        hc, yc = h[start:start + chunk_tokens], y[start:start + chunk_tokens]
        if torch.is_grad_enabled() and hc.requires_grad:
            total = total + checkpoint(_chunk_ce, head, hc, yc, use_reentrant=False)
        else:
            total = total + _chunk_ce(head, hc, yc)
    return total


class LossModel(nn.Module):
    """A causal LM whose forward returns (loss_share, ce_sum) from a local (CP-sharded) batch.

    This is the module handed to Accelerate (DDP / FSDP2), so the head and the decoder run inside one
    wrapped forward. The causal LM's own forward is called (its CP checks run as hooks on it) with
    `logits_to_keep` = no position, and the decoder's final hidden states are taken from a hook.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int = 1024):
        super().__init__()
        self.model = model  # as given (peft-wrapped or not): state dicts keep its key names
        self.chunk_tokens = chunk_tokens
        lm = base_causal_lm(model)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    @property
    def lm(self) -> nn.Module:
        return base_causal_lm(self.model)

    @property
    def head(self) -> LogitHead:
        return LogitHead(self.lm)

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep_logits: bool = False,
               cu_seq_lens: torch.Tensor | None = None):
        """(final hidden states (batch, local_len, hidden), logits or None). cu_seq_lens: the packed
        documents' global boundaries of a local batch (cp.shard_batch's cu_seq_lens_q), if any."""
        lm = self.lm
        grabbed = {}

        def grab(module, args, output):
            grabbed["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        hook = lm.get_decoder().register_forward_hook(grab)
        try:
            keep = 0 if keep_logits else torch.empty(0, dtype=torch.long, device=input_ids.device)
            packed = {} if cu_seq_lens is None else {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens}
            out = lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep, **packed)
        finally:
            hook.remove()
        return grabbed["h"], (out.logits if keep_logits else None)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                num_loss_tokens: int | torch.Tensor = 1, probe: bool = False,
                cu_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """labels: shifted local labels (-100 = no loss). Returns (ce_sum / num_loss_tokens, ce_sum).

        probe=True returns instead (max |model logits - chunked-head logits|, max |model logits|): it runs
        through the wrapped forward, so DDP/FSDP2 gather what they must exactly as in training.
        """
        if probe:
            h, ref = self.hidden(input_ids, position_ids, keep_logits=True)
            ref = ref.float()
            return (ref - self.head(h).float()).abs().max(), ref.abs().max()
        h, _ = self.hidden(input_ids, position_ids, cu_seq_lens=cu_seq_lens)
        ce_sum = chunked_ce_sum(self.head, h, labels, self.chunk_tokens)
        return ce_sum / max(int(num_loss_tokens), 1), ce_sum


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
