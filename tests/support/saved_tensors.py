"""What a decoder layer really saves for backward, counted with saved-tensor hooks: the planner's activation
formulas (longdoc/plan/memory.py, autocast.py) are tested against it."""

from __future__ import annotations

import torch


def saved_bytes_per_token(model, n: int = 256, layer_idx: int = 1) -> float:
    """Bytes of the tensors one decoder layer saves for backward (parameters excluded), per token."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = base.get_decoder().layers[layer_idx]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    active = [False]

    def pack(t):
        if active[0] and t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(lambda *a, **k: active.__setitem__(0, True), with_kwargs=True),
             layer.register_forward_hook(lambda *a, **k: active.__setitem__(0, False), with_kwargs=True)]
    ids = torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False)
    for h in hooks:
        h.remove()
    return sum(seen.values()) / n


SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             num_hidden_layers=3, vocab_size=256)
