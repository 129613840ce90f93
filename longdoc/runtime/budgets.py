"""Memory budgets and settings that the trainer, CPTrainer, the evaluations, the launcher and the planner share
(plain arithmetic and one libc call; no longdoc imports).

The loss chunk: the chunked cross-entropy (longdoc.hf.head) holds, per loss token of a chunk, fp32 log-probs, their
gradient and the logits' gradient: 12 bytes per vocabulary entry. Sized from the vocabulary, those buffers stay
under LOSS_CHUNK_BYTES whatever the model (a fixed 1,024 tokens at a 49k vocabulary cost 0.56 GiB per rank, more
than all the activations of a small model at a few thousand tokens).
"""

from __future__ import annotations

import ctypes

LOSS_CHUNK_BYTES = 256 * 2**20
_CHUNK_MULTIPLE = 64


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Loss tokens per chunk whose fp32 buffers (12 bytes per token and vocabulary entry) fit `budget_bytes`: a
    multiple of 64, at least 64 (SmolLM2's 49,152 entries: 448 tokens, 0.25 GiB; Llama 3's 128,256: 128)."""
    rows = budget_bytes // (12 * max(int(vocab_size), 1))
    return max(_CHUNK_MULTIPLE, rows // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)


def return_freed_memory() -> bool:
    """Make glibc give freed memory back to the OS at once; True where it applied (glibc only).

    By default glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB)
    and keeps freed heap memory for reuse. A training step frees gigabytes of activations in blocks of a
    few MiB, so the process keeps 0.5-2 GiB more than its live tensors (measured with SmolLM2-135M at 1k-4k
    tokens), an amount that depends on allocation order. A fixed 128 KiB threshold makes every larger
    tensor its own mapping, unmapped when freed: the resident size then follows the live tensors. The
    price is a page fault per fresh page, a few percent of a CPU step.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
    return bool(libc.mallopt(m_mmap_threshold, 128 * 1024)) and bool(libc.mallopt(m_trim_threshold, 128 * 1024))
