"""The DSA indexer's selection under the stable rule (longdoc.hf.kinds.dsa): one indexer of a tiny DeepSeek-V3.2,
run by longdoc's tiled selection at several tile shapes and as the zigzag pieces of 2 and 3 ranks, on any device.

    case = indexer_case(device, seed=0)
    full = select(case, rows_per_tile=None)        # one tile: the whole row, as one process
    assert torch.equal(select(case, rows_per_tile=3), full)

Some index keys are set to exactly zero: their score is 0 for every query whatever the accumulation order, so
ties at the k-th place are certain (crafted); the two index heads' relu makes more of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from longdoc.hf.kinds import dsa
from longdoc.parallel import layout as layouts
from tests.support.hf_dsa import TOPK, dsa_config

LENGTH = 48
ZERO_KEYS = (1, 2, 4, 7, 11, 12, 13, 20, 21, 30)  # index keys set to 0: exact ties at score 0


@dataclass
class Case:
    forward: object  # the indexer's bound forward
    call: dict  # its arguments for the whole row (batch 2)
    keys: torch.Tensor  # (2, LENGTH, index_head_dim) the row's index keys, ZERO_KEYS zeroed
    heads: int


def indexer_case(device: str | torch.device = "cpu", seed: int = 0) -> Case:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding

    config = dsa_config("deepseek_v32")
    torch.manual_seed(seed)
    indexer = DeepseekV32Indexer(config, layer_idx=0).to(device).eval()
    for p in indexer.parameters():
        p.data.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, LENGTH, config.hidden_size, generator=g).to(device)
    q_resid = torch.randn(2, LENGTH, config.q_lora_rank, generator=g).to(device)
    pos = torch.arange(LENGTH, device=device)[None].expand(2, -1)
    cos, sin = DeepseekV32RotaryEmbedding(config).to(device)(hidden, pos)
    call = dsa._bind(indexer.forward, (), dict(hidden_states=hidden, q_resid=q_resid, position_embeddings=(cos, sin),
                                               attention_mask=None, position_ids=pos, cache=None))
    keys = dsa._local_keys(indexer.forward, call).clone()
    keys[:, list(ZERO_KEYS)] = 0
    return Case(indexer.forward, call, keys, dsa._heads(indexer))


def select(case: Case, rows_per_tile: int | None = None, stable: bool | None = True) -> torch.Tensor:
    """(2, LENGTH, TOPK) global key indices of the whole row, in tiles of `rows_per_tile` queries (None: one)."""
    saved = dsa.SCORE_ELEMENTS
    if rows_per_tile is not None:
        dsa.SCORE_ELEMENTS = rows_per_tile * case.heads * 2 * LENGTH
    try:
        return dsa._select(case.forward, case.call, case.keys, [(0, 0, LENGTH, 0, LENGTH)], case.heads, TOPK, TOPK,
                           stable)
    finally:
        dsa.SCORE_ELEMENTS = saved


def select_as_ranks(case: Case, world: int, layout: str = "zigzag", rows_per_tile: int | None = None,
                    stable: bool | None = True) -> torch.Tensor:
    """The same selection made by each of `world` ranks for its own queries (its layout pieces), in global order."""
    out = torch.full((2, LENGTH, TOPK), -2, dtype=torch.int32, device=case.keys.device)
    saved = dsa.SCORE_ELEMENTS
    if rows_per_tile is not None:
        dsa.SCORE_ELEMENTS = rows_per_tile * case.heads * 2 * LENGTH
    try:
        for rank in range(world):
            cp = SimpleNamespace(layout=layout, rank=rank, size=world)
            runs = layouts.runs(layout, rank, world, LENGTH, None)
            idx = torch.cat([torch.arange(s, s + n) for s, n in runs]).to(case.keys.device)
            local = {k: (v[:, idx] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == LENGTH else
                         tuple(t[:, idx] for t in v) if isinstance(v, tuple) else v) for k, v in case.call.items()}
            got = dsa._select(case.forward, local, case.keys, dsa._pieces(cp, LENGTH, None, LENGTH), case.heads,
                              TOPK, TOPK, stable)
            out[:, idx] = got
    finally:
        dsa.SCORE_ELEMENTS = saved
    return out


def row_scores(case: Case) -> torch.Tensor:
    """(2, LENGTH, LENGTH) the float64 index scores the stable rule ranks (later keys -inf), from one tile."""
    seen = []
    topk = dsa.stable_topk

    def capture(x, k):
        seen.append(x)
        return topk(x, k)

    dsa.stable_topk = capture
    try:
        select(case)
    finally:
        dsa.stable_topk = topk
    return torch.cat(seen, dim=1)


def by_rule(scores: torch.Tensor) -> torch.Tensor:
    """The selection by definition: the TOPK highest scores, equal scores by lower key index (plain Python)."""
    b, n, t = scores.shape
    rows = scores.double().cpu().tolist()
    return torch.tensor([[sorted(range(t), key=lambda j: (-rows[r][i][j], j))[:TOPK] for i in range(n)]
                         for r in range(b)], dtype=torch.int32)


def exact_ties(scores: torch.Tensor) -> int:
    """Rows whose TOPK-th and next scores are equal and finite: the ties the rule must break."""
    v = scores.sort(dim=-1, descending=True).values
    return int(((v[..., TOPK - 1] == v[..., TOPK]) & torch.isfinite(v[..., TOPK])).sum())
