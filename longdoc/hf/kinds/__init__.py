"""Layer kinds beyond attention that longdoc knows how to shard: the ONE place they are found and swapped.

Attention of every pattern goes through the "longdoc_cp" backend (longdoc.hf.attention). Some layers are not
attention: recurrent / linear-attention / SSM mixers (Mamba, Gated DeltaNet, ...), short convolutions, the
DSA indexer. Each kind is one file under longdoc/hf/kinds/ that registers one entry (longdoc.hf.kinds.registry)
in the table of its shape:

    register(Routed(                               # ROUTED: the module's own forward, entry points routed
        name="mamba2",
        classes=frozenset({"Mamba2Mixer", "BambaMixer"}),
        routes=routes,                             # routes(call) -> {entry point: its CP version}
        routed=ROUTED, required=REQUIRED,          # what it routes; what a forward must have called
        layer_types=frozenset({"mamba"}),          # config.layer_types entries its layers carry
        hybrid_types=frozenset({"hybrid"}),        # entries where it runs BESIDE the layer's attention
    ))
    register(Forward(name=..., matches=..., forward=cp_forward, packed=True))   # FORWARDS: longdoc's own forward
    register(AttentionTweak(name=..., matches=..., forward=...))               # ATTENTION_TWEAKS: beside attention
    register(Refused(name=..., matches=..., problem=...))                      # REFUSED: refused by name

The four are read as one tuple `KINDS` of `LayerKind` views (name, matches, forward, problem, layer types, what
it handles). `patch` calls `attach(hf, handle)`: every module a kind matches gets its `forward` swapped (an
instance attribute; the model's classes and code are never edited) for `Swapped`, which counts the call on the
handle and runs `kind.forward` with the module's original bound forward. `detach` undoes it. The kind's forward
reads everything else from the handle: `handle.cp`, `handle.strategy`, `handle.documents` (packed rows),
`handle.session` (a KV session's prefill / extend). The maths of each kind lives in longdoc.parallel (torch only,
knowing no model); a kind file is the adapter from one family's module to that maths.

A module that looks like a sequence mixer but no kind matches is refused by name (`unknown_mixers`), so a
hybrid model never runs its recurrent layers on sharded tokens unhandled.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from longdoc.hf import recurrent, upstream

# Each kind module registers its entry at import (in this order within its table: the matching order).
from longdoc.hf.kinds import (  # noqa: F401 - imported for their registrations
    compressed,
    dsa,
    gated_deltanet,
    inkling,
    kda,
    lightning,
    mamba,
    mamba2,
    ngram,
    rglru,
    rwkv,
    shortconv,
    temperature,
    xlstm,
    zaya,
)
from longdoc.hf.kinds.registry import (
    ATTENTION_TWEAKS,
    FORWARDS,
    REFUSED,
    ROUTED,
    TABLES,
    AttentionTweak,
    Entry,
    Forward,
    LayerKind,
    Refused,
    Routed,
    _no_problem,  # noqa: F401 (kinds._no_problem: the default problem)
    register,
)


def _refused_forward(name: str) -> Callable:
    def forward(module, handle, original, *args, **kwargs):
        raise RuntimeError(f"longdoc: a {name} layer ran under CP although patch refuses it")  # never reached
    return forward


def view(entry: Entry) -> LayerKind:
    """The LayerKind that patch and the session read for a registered entry of any table."""
    if isinstance(entry, Routed):
        name = entry.name

        def routed_forward(module, handle, original, *args, **kwargs):
            e = ROUTED[name]  # the table's entry at call time (a test may replace it)
            return recurrent.forward(module, handle, original, args, kwargs, e.routes, e.required)

        return LayerKind(name, lambda m: type(m).__name__ in ROUTED[name].classes, routed_forward,
                         entry.layer_types, entry.hybrid_types, lambda m, h: recurrent.unrouted(m, ROUTED[name].routed),
                         entry.replaces_attention, packed=True, decode=True)
    if isinstance(entry, Forward):
        return LayerKind(entry.name, entry.matches, entry.forward, entry.layer_types, entry.hybrid_types,
                         replaces_attention=entry.replaces_attention, packed=entry.packed, decode=entry.decode)
    if isinstance(entry, AttentionTweak):
        return LayerKind(entry.name, entry.matches, entry.forward, entry.layer_types, problem=entry.problem,
                         replaces_attention=False, packed=entry.packed, decode=entry.decode)
    return LayerKind(entry.name, entry.matches, _refused_forward(entry.name), entry.layer_types, entry.hybrid_types,
                     entry.problem, replaces_attention=False)


# The registered kinds, in matching order (first match wins): every table's entries, as LayerKind views.
KINDS: tuple[LayerKind, ...] = tuple(view(e) for table in TABLES for e in table.values())

# Sequence mixers that must never run on sharded tokens without a kind (refused by name): these class names,
# and any convolution or padding module (a time shift) inside the decoder. Case-sensitive, so that e.g.
# "GptOssModel" or GPT-2's Conv1D (a linear layer) do not match.
_MIXER_NAMES = re.compile(r"Mamba\w*Mixer|Mixer$|DeltaNet|DeltaAttention|LinearAttention|LightningAttention|Rglru|"
                          r"RGLRU|RecurrentBlock|ShortConv|Indexer$|xLSTMBackend|mLSTM|sLSTM|RwkvSelfAttention|"
                          r"RwkvFeedForward|Retention|Hyena")
_MIXER_MODULES = (nn.Conv1d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d)
# Attention modules (through AttentionInterface) whose names the pattern above catches: Kimi Linear's full (MLA)
# attention is named after the model, not after linear attention.
_ATTENTION_NAMES = frozenset({"KimiLinearAttention"})


class Swapped:
    """A module's swapped `forward`: counts the call on the handle, then runs the kind's CP forward."""

    def __init__(self, kind: LayerKind, module: nn.Module, original: Callable):
        self.kind, self.original = kind, original
        self.module_ref = module  # deep copies of the model map this to the copy (memo), like the handle

    def __call__(self, *args, **kwargs):
        module = self.module_ref
        handle = module._longdoc_cp
        handle.kind_calls[self.kind.name] = handle.kind_calls.get(self.kind.name, 0) + 1
        return self.kind.forward(module, handle, self.original, *args, **kwargs)


def kind_of(module: nn.Module) -> LayerKind | None:
    for kind in KINDS:
        if kind.matches(module):
            return kind
    return None


def find(hf: nn.Module) -> list[tuple[str, nn.Module, LayerKind]]:
    """(qualified name, module, kind) for every module of `hf` a registered kind matches."""
    out = []
    for name, m in hf.named_modules():
        kind = kind_of(m)
        if kind is not None:
            out.append((name, m, kind))
    return out


def unknown_mixers(hf: nn.Module) -> list[str]:
    """Names of the decoder's modules that look like sequence mixers (see _MIXER_NAMES) but that no registered
    kind matches: they must be refused, never run on each rank's tokens unhandled."""
    from transformers import PreTrainedModel

    handled, handled_names = set(), []
    for name, m, _ in find(hf):
        handled.update(id(s) for s in m.modules())
        handled_names.append(name + ".")
    try:
        scope = hf.get_decoder()  # multimodal models: their encoders never see the sharded text tokens
    except (AttributeError, NotImplementedError, TypeError):
        scope = None
    prefix, scope = ("", hf) if scope is None else (next((n for n, m in hf.named_modules() if m is scope), ""), scope)
    out = []
    for name, m in scope.named_modules():
        if id(m) in handled or isinstance(m, PreTrainedModel) or type(m).__name__ in _ATTENTION_NAMES:
            continue
        qualified = ".".join(p for p in (prefix, name) if p)
        if any(h.startswith(qualified + ".") for h in handled_names):
            continue  # a container of handled mixers (e.g. OlmoHybridLinearAttentionDecoderLayer), no mixer itself
        if isinstance(m, _MIXER_MODULES) or _MIXER_NAMES.search(type(m).__name__):
            out.append(f"{qualified} ({type(m).__name__})")
    return out


def layer_types(hf: nn.Module) -> frozenset[str]:
    """The config.layer_types entries the kinds present in `hf` cover (alone or beside attention)."""
    found = find(hf)
    return frozenset().union(*(k.layer_types | k.hybrid_types for _, _, k in found)) if found else frozenset()


def attention_layers(config, n_layers: int, hf: nn.Module) -> int:
    """How many attention calls one forward makes: the layers, less those a kind replaces entirely."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = list(getattr(text, "layer_types", None) or ())
    replaced = frozenset().union(*(k.layer_types for _, _, k in find(hf) if k.replaces_attention)) \
        if find(hf) else frozenset()
    if types:
        return sum(t not in replaced for t in types)
    # No layer_types (e.g. pure SSM models): every layer is one module of a replacing kind, or attention.
    mixers = sum(1 for _, _, k in find(hf) if k.replaces_attention)
    return max(0, n_layers - mixers)


def problems(hf: nn.Module, handle) -> tuple[str, str] | None:
    """The first (feature, fix) a kind refuses on this model, or a mixer no kind handles."""
    for name, m, kind in find(hf):
        # upstream code the kind re-implements must be the source it was written against (longdoc.hf.upstream)
        problem = upstream.problem(kind.name, m) or kind.problem(m, handle)
        if problem is not None:
            return f"{problem[0]} (in {name})", problem[1]
    unknown = unknown_mixers(hf)
    if unknown:
        return (f"sequence-mixing layers longdoc has no context-parallel route for ({', '.join(unknown[:3])}"
                f"{', ...' if len(unknown) > 3 else ''})",
                "such layers (recurrent, state-space, convolution or indexer layers) would run on each rank's "
                "tokens alone; run this model without CP")
    return None


def attach(hf: nn.Module, handle) -> int:
    """Swap the forward of every module a kind matches; returns how many were swapped."""
    n = 0
    for _, m, kind in find(hf):
        current = m.__dict__.get("forward")
        if isinstance(current, Swapped):
            continue
        m.forward = Swapped(kind, m, m.forward)
        n += 1
    handle.kind_calls = {}
    handle.layer_kinds = tuple({kind.name: kind for _, _, kind in find(hf)}.values())
    return n


def detach(hf: nn.Module) -> None:
    """Undo `attach`."""
    for m in hf.modules():
        if isinstance(m.__dict__.get("forward"), Swapped):
            del m.__dict__["forward"]


def expected_calls(hf: nn.Module) -> dict[str, int]:
    """kind name -> how many swapped modules of that kind one forward runs (each exactly once)."""
    out: dict[str, int] = {}
    for _, _, kind in find(hf):
        out[kind.name] = out.get(kind.name, 0) + 1
    return out


def check_calls(handle, expected: dict[str, int]) -> None:
    """After a forward: every swapped module ran through its kind (a model that bypassed one is not exact)."""
    for name, n in expected.items():
        got = handle.kind_calls.get(name, 0)
        if got < n:
            raise RuntimeError(f"longdoc.patch: only {got} of {n} {name} layers of {handle.model_name} ran through "
                               f"their context-parallel route; the outputs are NOT exact")


def is_swapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), Swapped)


__all__ = ["LayerKind", "KINDS", "ROUTED", "FORWARDS", "ATTENTION_TWEAKS", "REFUSED", "Routed", "Forward",
           "AttentionTweak", "Refused", "register", "view", "Swapped", "attach", "detach", "find", "unknown_mixers",
           "problems", "attention_layers", "expected_calls", "check_calls", "kind_of", "layer_types", "is_swapped"]

