"""Layer kinds beyond attention that longdoc knows how to shard: the ONE place they are found and swapped.

Attention of every pattern goes through the "longdoc_cp" backend (longdoc.hf.attention). Some layers are not
attention: recurrent / linear-attention / SSM mixers (Mamba, Gated DeltaNet, ...), short convolutions, the
DSA indexer. Each such kind is one `LayerKind` (one file under longdoc/hf/kinds/, listed in `KINDS`):

    KIND = LayerKind(
        name="mamba2",
        layer_types=frozenset({"mamba"}),          # config.layer_types entries its layers carry
        hybrid_types=frozenset({"hybrid"}),        # entries where it runs BESIDE the layer's attention
        matches=lambda m: type(m).__name__ in {"Mamba2Mixer", "BambaMixer"},
        forward=cp_forward,                        # cp_forward(module, handle, original, *args, **kwargs)
        problem=fused_kernel_problem,              # (feature, fix) to refuse a module by name, or None
        replaces_attention=True,                   # its layers have no attention module of their own
        packed=True, decode=True,                  # what it handles exactly (else refused by name)
    )

`patch` calls `attach(hf, handle)`: every module a kind matches gets its `forward` swapped (an instance
attribute; the model's classes and code are never edited) for `Swapped`, which counts the call on the handle
and runs `kind.forward` with the module's original bound forward. `detach` undoes it. The kind's forward reads
everything else from the handle: `handle.cp`, `handle.strategy`, `handle.documents` (packed rows),
`handle.session` (a KV session's prefill / extend). The maths of each kind lives in longdoc.parallel
(torch only, knowing no model); a kind file is the adapter from one family's module to that maths.

A module that looks like a sequence mixer but no kind matches is refused by name (`unknown_mixers`), so a
hybrid model never runs its recurrent layers on sharded tokens unhandled.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from longdoc.hf import upstream

# LayerKind lives in base.py so that the kind files can import it without importing this package's __init__
# (which imports them: an import cycle otherwise).
from longdoc.hf.kinds.base import LayerKind, _no_problem  # noqa: F401 (kinds._no_problem: the default)

# The registered kinds, in matching order (first match wins). Each entry: longdoc/hf/kinds/<name>.py's KIND.
KINDS: tuple[LayerKind, ...] = ()


def _register() -> tuple[LayerKind, ...]:
    from longdoc.hf.kinds import (  # noqa: PLC0415 - the kind files import this module
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
        xlstm,
        zaya,
    )

    return (mamba2.KIND, mamba2.KIND_PARALLEL, mamba.KIND, shortconv.KIND, inkling.KIND, gated_deltanet.KIND,
            kda.KIND, lightning.KIND, rglru.KIND, rwkv.KIND, xlstm.KIND, ngram.KIND, zaya.KIND)

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


# The registered kinds: the recurrent / linear-attention / conv ones (_register), then the attention-side ones
# (imported last: each kind file imports LayerKind from kinds.base).
from longdoc.hf.kinds import compressed as _compressed  # noqa: E402
from longdoc.hf.kinds import dsa as _dsa  # noqa: E402
from longdoc.hf.kinds import temperature as _temperature  # noqa: E402

KINDS = (*_register(), _dsa.KIND, _temperature.KIND, _compressed.KIND)

__all__ = ["LayerKind", "KINDS", "Swapped", "attach", "detach", "find", "unknown_mixers", "problems",
           "attention_layers", "expected_calls", "check_calls", "kind_of", "layer_types", "is_swapped"]

