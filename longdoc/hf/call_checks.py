"""What a patched model's forward checks in the whole call, before any communication: the problems only the
call shows (positions, a filled cache, masks, token ids, row lengths), as (what, fix) pairs that
longdoc.hf.patch raises by name on every rank alike."""

from __future__ import annotations

import torch

from longdoc.hf import pairs
from longdoc.hf.attention import CPHandle
from longdoc.hf.modelinfo import rope_limit
from longdoc.parallel import batch_branches
from longdoc.parallel import layout as layouts
from longdoc.parallel.batch import ROW_LENGTHS, documents_of
from longdoc.parallel.batch_branches import BRANCHES


def right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (or all ones / all zeros)."""
    m = mask.to(torch.int8)
    return bool((m[:, 1:] <= m[:, :-1]).all()) if m.shape[1] > 1 else True


class InputProblem(tuple):
    """A (what, fix) problem with the call's inputs rather than with a model feature."""

    def __new__(cls, what: str, fix: str):
        return super().__new__(cls, (what, fix))


PADDING_FIX = ("build the local batch with cp.shard_batch: it turns left padding into right padding (which "
                "needs no mask) and passes no attention_mask on")


def _packed_problem(handle: CPHandle, call: dict, cu, pos: torch.Tensor, bsz: int, global_len: int,
                    branches) -> tuple[str, str] | None:
    """What is wrong with a packed call (documents from cu_seq_lens_q, preference pairs from `branches`), or None
    after keeping its documents and pairs on the handle."""
    cp = handle.cp
    if call.get("cu_seq_lens_k") is not None and not torch.equal(call["cu_seq_lens_k"], cu):
        return InputProblem("cu_seq_lens_k different from cu_seq_lens_q", "pass the batch cp.shard_batch made")
    try:
        docs = documents_of(cu, bsz, global_len)
        for d in docs:
            d.check(cp.size)
    except ValueError as e:
        return InputProblem("cu_seq_lens_q that are not the global document boundaries of this batch",
                            f"pass the packed batch cp.shard_batch made ({e})")
    try:
        rows = pairs.read(branches, docs)
    except ValueError as e:
        return InputProblem(f"{BRANCHES} that are not this batch's preference pairs",
                            f"pass the local batch cp.shard_batch made, unchanged ({e})")
    expected = torch.stack([cp.shard(batch_branches.position_ids(b, d, pos.device), dim=0, documents=d)
                            for b, d in zip(rows or [None] * len(docs), docs)])
    if pos.shape != expected.shape or not bool((pos == expected).all()):
        return InputProblem("position_ids that are not this rank's positions within its packed documents",
                            "pass the position_ids made by cp.shard_batch for the packed batch")
    unpacked = sorted({k.name for k in handle.layer_kinds if not k.packed})
    if unpacked:
        return (f"packed rows (documents) through its {', '.join(unpacked)} layers",
                "those layers do not reset their state at document starts under CP yet; pass unpacked rows")
    if rows is not None and handle.layer_kinds:
        return (f"preference pairs (branches) through its {', '.join(sorted({k.name for k in handle.layer_kinds}))} "
                f"layers", "only attention layers compute sibling branches under CP; pass rows without branches")
    handle.documents, handle.documents_from = tuple(docs), cu
    pairs.keep(handle, cu, rows)
    return None


def call_problem(handle: CPHandle, call: dict, branches=None) -> tuple[str, str] | None:
    """What is wrong with the call's inputs, or None. branches: cp.shard_batch's preference pairs (batch_branches)."""
    cp = handle.cp
    x = call.get("input_ids")
    x = call.get("inputs_embeds") if x is None else x
    if x is None or x.dim() < 2:
        return None  # the model itself raises its own clear error
    cache = call.get("cache", call.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        return ("a filled KV cache", "a plain forward under CP runs without one (use_cache=False); to decode, "
                "call longdoc.hf.generate(model, cp, input_ids, max_new_tokens) or model.generate, which routes "
                "there")
    local_len = x.shape[1]
    global_len = local_len * cp.size
    pos = call.get("position_ids")
    if pos is None:
        return InputProblem("no position_ids", "under CP every rank must pass the GLOBAL positions of its tokens "
                "(cp.shard_batch provides them); without them RoPE would see local positions")
    cu = call.get("cu_seq_lens_q")
    if branches is not None and cu is None:
        return InputProblem(f"{BRANCHES} without packed documents (cu_seq_lens_q)",
                            "pass the local batch cp.shard_batch made from a batch with branches, unchanged")
    if cu is not None:
        problem = _packed_problem(handle, call, cu, pos, x.shape[0], global_len, branches)
        if problem is not None:
            return problem
    else:
        chunks = len(layouts.chunk_ids(cp.layout, 0, cp.size))
        if local_len % chunks:
            return InputProblem(f"a local sequence of {local_len} tokens",
                                f"the {cp.layout} layout holds {chunks} equal chunks per rank; build the local "
                                f"batch with cp.shard_batch, which pads")
        # Each row: this rank's global positions plus one offset >= 0 (a row numbered from another start,
        # such as a left-padded row that cp.shard_batch rolled to the right, every token keeping its id).
        bad = InputProblem("position_ids that are not this rank's global positions",
                     "pass the position_ids made by cp.shard_batch (it handles packed rows and left padding)")
        if pos.shape[-1] != local_len:
            return bad
        offset = pos - cp.positions(global_len, device=pos.device)
        if not bool((offset == offset[..., :1]).all()) or bool((offset < 0).any()):
            return bad
        if offset.numel():
            global_len += int(offset.max())  # the largest position id + 1, for the RoPE threshold below
    if call.get("labels") is not None and call.get("shift_labels") is None:
        return InputProblem("labels without shift_labels",
                            "labels must be shifted over the FULL sequence before sharding; build the batch with "
                            "cp.shard_batch (it passes shift_labels and num_items_in_batch)")
    if call.get("shift_labels") is not None and call.get("num_items_in_batch") is None:
        return InputProblem("shift_labels without num_items_in_batch", "pass the global number of loss tokens "
                "(cp.shard_batch does) so that the per-rank losses sum to the mean")
    if call.get("output_router_logits") and handle.router_problem is not None:
        return handle.router_problem
    limit = rope_limit(handle.config)
    if limit is not None and global_len > limit[1]:
        return (f"RoPE scaling {limit[0]!r} at {global_len} tokens (beyond its {limit[1]}-token threshold)",
                "this scaling picks frequencies from the largest position id each rank sees, which differs "
                "per rank; use sequences within the threshold or a static RoPE scaling (linear, yarn, llama3)")
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return (f"a custom {mask.dim()}-D attention mask", "pass a 2-D right-padding mask, or none")
    return None


def vocab_problem(module, call: dict) -> InputProblem | None:
    # An id past the embedding is an IndexError deep in torch on CPU and a device-side assert on GPU;
    # a negative one would silently index from the end. Checked here, it is one clear error on every rank.
    ids = call.get("input_ids")
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if ids is None or n is None or ids.numel() == 0 or ids.is_floating_point():
        return None
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= n:
        return InputProblem(f"token ids spanning [{low}, {high}] (its embedding has {n} rows, ids 0..{n - 1})",
                      "the ids come from another tokenizer or from a bad padding id; tokenize with this model's "
                      "tokenizer (len(tokenizer) must not exceed the embedding; see model.resize_token_embeddings)")
    return None


def row_lengths_problem(lengths, call: dict, global_len: int) -> InputProblem | None:
    x = call.get("input_ids", call.get("inputs_embeds"))
    if lengths is None or x is None:
        return None
    if not torch.is_tensor(lengths) or lengths.dim() != 1 or lengths.shape[0] != x.shape[0] \
            or lengths.is_floating_point() or bool((lengths < 0).any()) or bool((lengths > global_len).any()):
        return InputProblem(f"{ROW_LENGTHS} that are not the batch's row lengths",
                      "pass the local batch cp.shard_batch made, unchanged")
    return None


def layerdrop_problem(module) -> tuple[str, str] | None:
    """LayerDrop skips whole layers at random in training mode (OPT, BioGPT, XGLM, the BART-style decoders): each
    CP rank would draw its own skips, run other layers than its peers, and issue other collectives."""
    config = getattr(module, "config", None)
    if not getattr(module, "training", False) or config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("layerdrop", "decoder_layerdrop"):
        p = getattr(text, key, None)
        if isinstance(p, (int, float)) and p > 0:
            return (f"LayerDrop in training mode (config.{key} = {p})",
                    f"each CP rank would skip other layers than its peers; set config.{key} = 0 (or call "
                    f"model.eval())")
    return None
