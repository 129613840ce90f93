"""Sequence-tiled MLP (ALST's TiledMLP idea, written here): the MLP runs over tiles of the local tokens, forward
and backward, with recompute, so no (tokens x intermediate) tensor of the full local length is ever alive.

    tile_mlps(model, tile_tokens=None)   # a pass over the model: each known MLP's forward is wrapped in place
    untile_mlps(model)

The forward runs the module's own forward tile by tile under no_grad and saves only its inputs; the backward
recomputes each tile with grad enabled and accumulates the parameter gradients and the input gradient tile by
tile. Every op of a known MLP acts on each token alone, so tiling is exact up to the order of the parameter-gradient
sums (fp32 ~1e-7 relative). MoE: the router runs untiled, once, as the model wrote it (router logits and the
auxiliary loss are unchanged); the experts and shared experts are tiled with the routing of their tokens.
An MLP class not in the tables below is refused by name: a sequence-mixing op inside it would make tiling wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longdoc.hf.modelinfo import UnsupportedFeatureError

# dense per-token MLPs: class name -> the submodules its forward uses (checked, so an upstream rename is refused)
DENSE: dict[str, tuple[str, ...]] = {
    **{name: ("gate_proj", "up_proj", "down_proj") for name in (  # gated SiLU / GeLU
        "LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP", "StableLmMLP",
        "Qwen2MoeMLP", "Qwen3MoeMLP", "OlmoeMLP", "SmolLM3MLP", "Olmo2MLP", "GraniteMLP", "CohereMLP",
        "Llama4TextMLP")},
    "Phi3MLP": ("gate_up_proj", "down_proj"),  # gated, fused gate/up projection
    "GraniteMoeHybridMLP": ("input_linear", "output_linear"),  # gated, fused
    "PhiMLP": ("fc1", "fc2"),  # plain GeLU
    "GPT2MLP": ("c_fc", "c_proj"),  # plain GeLU (Conv1D)
    "Starcoder2MLP": ("c_fc", "c_proj"),
}
# routed experts: class name -> its parameters; forward(hidden (tokens, hidden), top_k_index, top_k_weights)
EXPERTS: dict[str, tuple[str, ...]] = {
    name: ("gate_up_proj", "down_proj")
    for name in ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts", "GptOssExperts",
                 "GraniteMoeHybridExperts")
}
# MoE blocks: class name -> (router, experts, shared experts or None); only the experts and shared experts are tiled
MOE_BLOCKS: dict[str, tuple[str, str, str | None]] = {
    "MixtralSparseMoeBlock": ("gate", "experts", None),
    "Qwen2MoeSparseMoeBlock": ("gate", "experts", "shared_expert"),
    "Qwen3MoeSparseMoeBlock": ("gate", "experts", None),
    "OlmoeSparseMoeBlock": ("gate", "experts", None),
    "GptOssMLP": ("router", "experts", None),
    "GraniteMoeHybridMoE": ("router", "experts", None),
}
# where decoder layers keep their MLP
MLP_ATTRS = ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp")
_MARK = "_longdoc_tiled"


class _Stash(torch.autograd.Function):
    """Saves the MLP's inputs, and nothing else, just before the MLP runs. Inside a checkpointed layer this is the
    layer's last saved tensor, so the checkpoint's recompute (early stop, torch's default) ends here instead of
    running the whole MLP forward once more: the tiled backward recomputes it tile by tile anyway."""

    @staticmethod
    def forward(ctx, *tokens: torch.Tensor):
        ctx.save_for_backward(*tokens)
        return tuple(t.view_as(t) for t in tokens)

    @staticmethod
    def backward(ctx, *grads):
        return grads


class TiledMLPFunction(torch.autograd.Function):
    """fn(*token_inputs) run over token tiles of every token input (dim 0) with recompute in the backward.

    Inputs: fn, tile, the number of token inputs n, the _Stash node holding them (None: they are saved here), the
    n token inputs (tokens first), then the parameters fn reads that need gradients (so autograd routes their
    gradients here).
    """

    @staticmethod
    def forward(ctx, fn: Callable, tile: int, n: int, stash, *inputs: torch.Tensor) -> torch.Tensor:
        tokens, params = inputs[:n], inputs[n:]
        device = tokens[0].device.type
        ctx.fn, ctx.tile, ctx.n, ctx.stash, ctx.params = fn, tile, n, stash, params
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        if stash is None:
            ctx.save_for_backward(*tokens)  # the only tensors kept: the inputs, never an intermediate
        return _run_tiles(fn, tokens, tile)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        tokens = ctx.stash.saved_tensors if ctx.stash is not None else ctx.saved_tensors
        params = ctx.params
        device, autocast_on, autocast_dtype = ctx.autocast
        wants = list(ctx.needs_input_grad[4:4 + ctx.n])
        token_grads = [torch.empty_like(t) if w else None for t, w in zip(tokens, wants)]
        # parameter gradients summed in fp32 for low-precision parameters: one rounding, as the untiled matmul does
        acc: list[torch.Tensor | None] = [None] * len(params)
        # one autocast region for all tiles: autocast caches its low-precision copies of the weights within a
        # region, so they are cast once per backward, not once per tile
        with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
            for start in range(0, tokens[0].shape[0], ctx.tile):
                sl = slice(start, start + ctx.tile)
                pieces = [t[sl].detach().requires_grad_(w) for t, w in zip(tokens, wants)]
                out = ctx.fn(*pieces)
                leaves = [p for p, w in zip(pieces, wants) if w] + list(params)
                grads = torch.autograd.grad(out, leaves, grad_out[sl], allow_unused=True)
                k = 0
                for i, w in enumerate(wants):
                    if w:
                        g = grads[k]
                        token_grads[i][sl] = 0 if g is None else g
                        k += 1
                for i, g in enumerate(grads[k:]):
                    if g is None:
                        continue
                    if acc[i] is None:
                        acc[i] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
                    else:
                        acc[i] += g
        param_grads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return None, None, None, None, *token_grads, *param_grads


def _run_tiles(fn: Callable, tokens, tile: int) -> torch.Tensor:
    """fn over the token tiles under no_grad, written into one output (no list of tile outputs kept)."""
    out = None
    total = tokens[0].shape[0]
    with torch.no_grad():
        if total == 0:
            return fn(*tokens)
        for start in range(0, total, tile):
            piece = fn(*(t[start:start + tile] for t in tokens))
            if out is None:
                out = piece.new_empty((total, *piece.shape[1:]))
            out[start:start + piece.shape[0]] = piece
    return out


def _tiled_call(module: torch.nn.Module, fn: Callable, tile: int, tokens: list[torch.Tensor]) -> torch.Tensor:
    params = [p for p in module.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (any(t.requires_grad for t in tokens) or bool(params))
    if not needs_grad:
        return _run_tiles(fn, tokens, tile)
    stashed = _Stash.apply(*tokens)
    node = stashed[0].grad_fn
    stash = node if isinstance(node, _Stash._backward_cls) else None  # None: no token input needs a gradient
    return TiledMLPFunction.apply(fn, tile, len(tokens), stash, *stashed, *params)


class _DenseForward:
    """The tiled forward of a dense MLP: x (..., hidden) -> (..., hidden), tiled over the flattened tokens."""

    def __init__(self, module: torch.nn.Module, tile: int):
        self.inner, self.tile, self.module_ref = module.forward, tile, module  # inner: the class's own forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
        out = _tiled_call(self.module_ref, self.inner, self.tile, [flat])
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _ExpertsForward:
    """The tiled forward of routed experts: (hidden, top_k_index, top_k_weights), all with tokens first."""

    def __init__(self, module: torch.nn.Module, tile: int):
        self.inner, self.tile, self.module_ref = module.forward, tile, module

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return _tiled_call(self.module_ref, self.inner, self.tile, [hidden, top_k_index, top_k_weights])


def _check_form(module: torch.nn.Module, parts: tuple[str, ...], where: str) -> None:
    name = type(module).__name__
    missing = [p for p in parts if not hasattr(module, p)]
    if missing:
        raise UnsupportedFeatureError(f"tiled MLP: {where} ({name}) has no {missing}: this transformers version "
                                      f"changed {name}; turn parallelism.tiled_mlp off")
    for sub_name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Dropout) and sub.p > 0:
            raise UnsupportedFeatureError(f"tiled MLP: {where}.{sub_name} is dropout with p={sub.p}; the tiles "
                                          f"would draw other masks than the untiled MLP. Set that dropout to 0 "
                                          f"(the model's config, or lora.dropout) or turn parallelism.tiled_mlp "
                                          f"off")


def _wrap(module: torch.nn.Module, kind: type, tile: int) -> None:
    if getattr(module, _MARK, False):
        module.forward.tile = tile  # tiled already: only the tile size changes
        return
    module.forward = kind(module, tile)
    setattr(module, _MARK, True)


def _tile_one(mlp: torch.nn.Module, where: str, tile: int) -> int:
    name = type(mlp).__name__
    if name in DENSE:
        _check_form(mlp, DENSE[name], where)
        _wrap(mlp, _DenseForward, tile)
        return 1
    if name in MOE_BLOCKS:
        router, experts, shared = MOE_BLOCKS[name]
        _check_form(mlp, tuple(p for p in (router, experts, shared) if p), where)
        ex = getattr(mlp, experts)
        if type(ex).__name__ not in EXPERTS:
            raise UnsupportedFeatureError(f"tiled MLP: {where}.{experts} is {type(ex).__name__}, an experts class "
                                          f"longdoc does not know how to tile (known: {sorted(EXPERTS)}); turn "
                                          f"parallelism.tiled_mlp off")
        _check_form(ex, EXPERTS[type(ex).__name__], f"{where}.{experts}")
        _wrap(ex, _ExpertsForward, tile)
        count = 1
        if shared is not None:
            count += _tile_one(getattr(mlp, shared), f"{where}.{shared}", tile)
        return count
    raise UnsupportedFeatureError(f"tiled MLP: {where} is {name}, an MLP class longdoc does not know how to tile "
                                  f"(known: {sorted(DENSE)} and the MoE blocks {sorted(MOE_BLOCKS)}); turn "
                                  f"parallelism.tiled_mlp off")


def _decoder_layers(model) -> list[tuple[str, torch.nn.Module]]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def default_tile_tokens(model) -> int:
    """ALST's choice: tiles of hidden_size tokens, so a tile's (tile x intermediate) activation is no larger than
    the MLP's own weight matrix."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.hidden_size)


def tile_mlps(model, tile_tokens: int | None = None) -> int:
    """Tile every decoder layer's MLP of `model` over `tile_tokens` tokens (None: default_tile_tokens); returns how
    many modules were wrapped. Raises UnsupportedFeatureError naming an MLP class it does not know."""
    tile = tile_tokens or default_tile_tokens(model)
    if tile <= 0:
        raise ValueError(f"tile_mlps: tile_tokens must be positive, got {tile}")
    count = 0
    for lname, layer in _decoder_layers(model):
        for attr in MLP_ATTRS:
            mlp = getattr(layer, attr, None)
            if isinstance(mlp, torch.nn.Module):
                count += _tile_one(mlp, f"{lname}.{attr}", tile)
    if count == 0:
        raise UnsupportedFeatureError(f"tiled MLP: no decoder layer of {type(model).__name__} has an MLP under "
                                      f"{MLP_ATTRS}; turn parallelism.tiled_mlp off")
    return count


def untile_mlps(model) -> None:
    """Undo tile_mlps: every wrapped module runs its class's forward again."""
    for m in model.modules():
        if getattr(m, _MARK, False):
            del m.forward
            delattr(m, _MARK)
