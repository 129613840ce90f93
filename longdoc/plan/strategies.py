"""The CP attention strategies in the planner: bytes moved, over which link, what overlaps, buffers.

Each strategy answers for itself, in its own module under longdoc/parallel/strategies/ (its `layer_cost`,
`buffers` and `kernel_block`, with the formulas in words there); these functions look it up by the name a Setup
carries and handle cp=1, where every strategy is the same computation with nothing to send.
Times are bytes / (link bandwidth x link efficiency) + a latency per message: formulas, with the assumptions of
`hardware.Assumptions` (GPU figures are not yet measured on a device).
"""

from __future__ import annotations

from longdoc.parallel import strategy as registry
from longdoc.parallel.cost import head_balance  # noqa: F401 - the planner's name for it
from longdoc.parallel.strategy import LayerComm


def ulysses_size(strategy: str, cp: int, ulysses: int | None) -> int:
    """Ranks per Ulysses group: cp for ulysses, the factor for usp, 1 for ring and allgather."""
    return registry.get(strategy).heads_split(cp, ulysses)


def check_heads(strategy: str, cp: int, ulysses: int | None, q_heads: int) -> None:
    """Ulysses splits query heads over its ranks: fewer heads than ranks is refused (as the CP core does)."""
    registry.get(strategy).check_heads(cp, ulysses, q_heads)


def kernel_block(strategy: str, cp: int, ulysses: int | None, tokens: int) -> int:
    """Query tokens of one attention kernel call: a zigzag chunk (N/2) for ring and allgather, the whole
    sequence (cp*N) for Ulysses, a zigzag chunk of the U*N-token group for usp; N at cp=1."""
    if cp == 1:
        return tokens
    return registry.get(strategy).kernel_block(cp, ulysses, tokens)


def kernel_efficiency(block: int, knee: float) -> float:
    """Fraction of the large-block attention rate reached on `block`-token query blocks (hardware.Device)."""
    return block / (block + knee)


def attention_layer(strategy: str, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int,
                    head_dim: int, c: int, t_fwd: float, t_bwd: float, bw_span, lat: float) -> LayerComm:
    """Time and bytes of one layer's attention. t_fwd/t_bwd: its kernel time at an even share of the work;
    bw_span(ranks): bytes/s of a group spanning that many consecutive ranks."""
    if cp == 1:
        return LayerComm(t_fwd, t_bwd, 0.0, 0.0)
    return registry.get(strategy).layer_cost(cp=cp, ulysses=ulysses, tokens=tokens, q_heads=q_heads,
                                             kv_heads=kv_heads, head_dim=head_dim, c=c, t_fwd=t_fwd, t_bwd=t_bwd,
                                             bw_span=bw_span, lat=lat)


def buffers(strategy: str, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int,
            head_dim: int, c: int) -> tuple[float, str]:
    """Bytes of the strategy's communication buffers live in a layer's attention backward, and the formula."""
    return registry.get(strategy).buffers(cp=cp, ulysses=ulysses, tokens=tokens, q_heads=q_heads, kv_heads=kv_heads,
                                          head_dim=head_dim, c=c)
