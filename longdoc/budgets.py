"""Memory budgets that the trainer, CPTrainer, the evaluations and the planner share (plain arithmetic, no imports).

The loss chunk: the chunked cross-entropy (longdoc.hf.head) holds, per loss token of a chunk, fp32 log-probs, their
gradient and the logits' gradient: 12 bytes per vocabulary entry. Sized from the vocabulary, those buffers stay
under LOSS_CHUNK_BYTES whatever the model (a fixed 1,024 tokens at a 49k vocabulary cost 0.56 GiB per rank, more
than all the activations of a small model at a few thousand tokens).
"""

from __future__ import annotations

LOSS_CHUNK_BYTES = 256 * 2**20
_CHUNK_MULTIPLE = 64


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Loss tokens per chunk whose fp32 buffers (12 bytes per token and vocabulary entry) fit `budget_bytes`: a
    multiple of 64, at least 64 (SmolLM2's 49,152 entries: 448 tokens, 0.25 GiB; Llama 3's 128,256: 128)."""
    rows = budget_bytes // (12 * max(int(vocab_size), 1))
    return max(_CHUNK_MULTIPLE, rows // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)
