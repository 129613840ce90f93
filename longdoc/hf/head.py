"""The causal-LM head without full logits: hidden states -> cross-entropy over chunks of tokens.

At 32k tokens and a 49k vocabulary, one rank's fp32 logits and their gradient are several GB, more than all the
rest of the step. `chunked_ce_sum` runs the head over `chunk_tokens` loss tokens at a time, each chunk under
activation checkpointing (its logits freed after the forward, recomputed in the backward), so at most one chunk's
logits exist. `loss_chunk_tokens(vocab)` (longdoc.runtime.budgets) sizes the chunk from the vocabulary: its fp32 buffers
(log-probs, their gradient and the logits' gradient, 12 bytes per token and vocabulary entry) stay under
LOSS_CHUNK_BYTES.

Used by longdoc.train (LossModel), CPTrainer (through `patch`'s chunked loss) and the evaluations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longdoc.runtime.budgets import LOSS_CHUNK_BYTES, loss_chunk_tokens  # noqa: F401  (re-exported)

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


def _chunk_ce(head: LogitHead, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
              stats: dict | None = None, key: int = 0) -> torch.Tensor:
    # (chunk, hidden) -> (chunk, vocab) in fp32 for a stable log-softmax; summed, not averaged, so that
    # the caller controls the normalization across chunks, micro-batches and ranks.
    logits = head(h).float()
    if stats is not None:
        # TRL-style token statistics of this chunk, keyed by its start: the backward's recompute writes the same
        with torch.no_grad():
            logp = torch.log_softmax(logits, dim=-1)
            stats[key] = torch.stack([torch.tensor(float(labels.numel()), dtype=torch.float64),
                                      -(logp.exp() * logp).sum().double().cpu(),
                                      (logits.argmax(dim=-1) == labels).sum().double().cpu()])
    if weights is None:
        return F.cross_entropy(logits, labels, reduction="sum")
    return (F.cross_entropy(logits, labels, reduction="none") * weights).sum()


def chunked_ce_sum(head: LogitHead, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                   weights: torch.Tensor | None = None, stats: dict | None = None) -> torch.Tensor:
    """Sum of token cross-entropies (each times its weight, when given); hidden (..., hidden_size), labels and
    weights (...) already shifted, -100 ignored. With `stats` (a dict), each chunk leaves its (loss tokens, sum of
    entropies, correct argmax predictions) there, keyed by its first loss token (float64, on the CPU)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    keep = labels != IGNORE
    # Only loss tokens go through the head: padding and masked prompt tokens cost nothing.
    h, y = hidden[keep], labels[keep]  # (n_loss_tokens, hidden), (n_loss_tokens,)
    w = weights.reshape(-1)[keep].float() if weights is not None else None
    total = hidden.new_zeros((), dtype=torch.float32)
    if y.numel() == 0:
        # No loss token on this rank (answer-only loss under zigzag: a rank may hold only prompt). It must
        # still run the same backward as its peers, through the body (the CP ring is a collective) AND the
        # head: DDP/FSDP reduce gradients in buckets that fire only once every parameter in them has one,
        # so a head without a gradient here would leave this rank's buckets unsent while the others send
        # theirs (issue 22). One token through the head, weighted 0: exact zeros for its gradient.
        return total + 0.0 * hidden.sum() + 0.0 * head(hidden[:1]).float().sum()
    for start in range(0, y.numel(), chunk_tokens):
        hc, yc = h[start:start + chunk_tokens], y[start:start + chunk_tokens]
        wc = w[start:start + chunk_tokens] if w is not None else None
        if torch.is_grad_enabled() and hc.requires_grad:
            total = total + checkpoint(_chunk_ce, head, hc, yc, wc, stats, start, use_reentrant=False)
        else:
            total = total + _chunk_ce(head, hc, yc, wc, stats, start)
    return total


@torch.no_grad()
def token_ce(head: LogitHead, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Each labelled token's cross-entropy (fp32, in the order of `labels`' non -100 entries), `chunk_tokens`
    tokens at a time: evaluation's per-token losses without (tokens x vocab) logits."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    keep = labels != IGNORE
    h, y = hidden[keep], labels[keep]
    parts = [F.cross_entropy(head(h[i:i + chunk_tokens]).float(), y[i:i + chunk_tokens], reduction="none")
             for i in range(0, y.numel(), chunk_tokens)]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
