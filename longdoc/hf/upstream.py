"""transformers code that longdoc's layer kinds re-implement, checked by source, refused by name when it changed.

Most kinds run the module's own forward (the routed kinds, whose entry points `recurrent.unrouted` checks, and the
DSA indexer) or refuse the module outright. Some instead compute the module's forward themselves, around the CP
maths (ZAYA's CCA projection, MiniMax's lightning attention, xLSTM's backend), or assume what a method or function
of its modeling file does (RecurrentGemma's `_rnn_scan`, RWKV's WKV scan, Llama 4's temperature formula). Such a
kind is exact only while that upstream source is the one it was written against. `REIMPLEMENTED` names, per kind,
the upstream objects it re-implements; `DIGESTS` holds the source digests (sha256 of `inspect.getsource`, trailing
whitespace dropped, first 16 hex digits) of the transformers versions the tests passed on. `problem` refuses a
module whose upstream source has no recorded digest, naming the class, the versions and the fix. Every kind is in
`REIMPLEMENTED` or `OWN_CODE` (a test enforces it), so a new kind cannot skip the question.

After the test suite passes on a new transformers release, record its sources:

    python -m longdoc.hf.upstream            # the installed version's digests, and which are new
    python -m longdoc.hf.upstream --update   # add them to DIGESTS in this file
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from longdoc.hf.recurrent import torch_path


@dataclass(frozen=True)
class Upstream:
    """What one layer kind re-implements.

    classes: qualified names of the transformers classes the kind matches (what `--update` and the tests read).
    names: per matched class, an attribute of the class ("forward"; through its MRO, to the class that defines
        it), or ":name" / ":Class.attr" looked up in the class's modeling module.
    """

    classes: tuple[str, ...]
    names: tuple[str, ...]


REIMPLEMENTED: dict[str, Upstream] = {
    # _row computes ZayaCCAProjection.forward's projections, convs and delayed value (with halos)
    "zaya_cca": Upstream(("transformers.models.zaya.modeling_zaya.ZayaCCAProjection",), ("forward",)),
    # the forward around the block loop, which longdoc.parallel.recurrent.lightning re-implements
    "lightning": Upstream(("transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention",),
                          ("forward",)),
    # the backend's forward, and the chunkwise kernel whose state recurrence and stabiliser parallel.recurrent.mlstm
    # composes in closed form
    "xlstm": Upstream(("transformers.models.xlstm.modeling_xlstm.xLSTMBackend",),
                      ("__init__", "forward", ":mlstm_chunkwise_native_autograd", ":mlstm_chunkwise_fw",
                       ":mlstm_chunkwise_recurrent_fw_C")),
    # the block's forward with conv_1d and _rnn_scan shadowed: how it calls them, the gates and the scan itself
    "rglru": Upstream(("transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock",),
                      ("forward", ":RecurrentGemmaRglru.forward", ":RecurrentGemmaRglru._rnn_scan")),
    # time_shift and the WKV entry point shadowed; the WKV scan's recurrence in closed form (parallel.recurrent.rwkv)
    "rwkv": Upstream(("transformers.models.rwkv.modeling_rwkv.RwkvSelfAttention",
                      "transformers.models.rwkv.modeling_rwkv.RwkvFeedForward"),
                     ("forward", ":rwkv_linear_attention", ":rwkv_linear_attention_cpu")),
    # query_temperature.scale_queries re-implements the attention's temperature tuning formula
    "llama4_temperature": Upstream(("transformers.models.llama4.modeling_llama4.Llama4TextAttention",),
                                   ("forward",)),
}

# Kinds that re-implement no transformers code, and why.
OWN_CODE: dict[str, str] = {
    **dict.fromkeys(("mamba2", "mamba2_parallel", "mamba", "shortconv", "gated_deltanet", "kda"),
                    "routed: the module's own forward, with kernel entry points checked by recurrent.unrouted"),
    "dsa_indexer": "the indexer's own forward, run with stand-in caches",
    **dict.fromkeys(("inkling", "ngram_embedding", "deepseek_v4_compressed"), "refused by name: nothing runs"),
}

# qualified name -> {source digest: the transformers versions the test suite passed on with that source}.
# Written by `python -m longdoc.hf.upstream --update`; keep the markers.
# BEGIN DIGESTS
DIGESTS: dict[str, dict[str, tuple[str, ...]]] = {
    "transformers.models.llama4.modeling_llama4.Llama4TextAttention.forward": {
        "35cd2cba9e570d53": ("5.24.0", "5.25.0"),
    },
    "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention.forward": {
        "acd2517436b48f5f": ("5.24.0", "5.25.0"),
    },
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock.forward": {
        "69b25ac927dc8d09": ("5.24.0", "5.25.0"),
    },
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru._rnn_scan": {
        "c53666efa20320a8": ("5.24.0", "5.25.0"),
    },
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru.forward": {
        "8ac9d9754bbedd0c": ("5.24.0", "5.25.0"),
    },
    "transformers.models.rwkv.modeling_rwkv.RwkvFeedForward.forward": {
        "2706219127a90644": ("5.24.0", "5.25.0"),
    },
    "transformers.models.rwkv.modeling_rwkv.RwkvSelfAttention.forward": {
        "29c6abfb2aa5da83": ("5.24.0", "5.25.0"),
    },
    "transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention": {
        "c1bc3fcea7363a53": ("5.24.0", "5.25.0"),
    },
    "transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention_cpu": {
        "560daab6a23bcd84": ("5.24.0", "5.25.0"),
    },
    "transformers.models.xlstm.modeling_xlstm.mlstm_chunkwise_fw": {
        "1555b31c45ee2ccc": ("5.24.0", "5.25.0"),
    },
    "transformers.models.xlstm.modeling_xlstm.mlstm_chunkwise_native_autograd": {
        "44ccee587ab832dc": ("5.24.0", "5.25.0"),
    },
    "transformers.models.xlstm.modeling_xlstm.mlstm_chunkwise_recurrent_fw_C": {
        "f162bb7465b10371": ("5.24.0", "5.25.0"),
    },
    "transformers.models.xlstm.modeling_xlstm.xLSTMBackend.__init__": {
        "68e825799abd4b66": ("5.24.0", "5.25.0"),
    },
    "transformers.models.xlstm.modeling_xlstm.xLSTMBackend.forward": {
        "1f7104ec0a7a44f9": ("5.24.0", "5.25.0"),
    },
    "transformers.models.zaya.modeling_zaya.ZayaCCAProjection.forward": {
        "e0327000ac32301a": ("5.24.0",),
        "4067fd12491469f9": ("5.25.0",),
    },
}
# END DIGESTS


def digest(source: str) -> str:
    """sha256 of a source text with trailing whitespace (of each line, and trailing blank lines) dropped."""
    text = "\n".join(line.rstrip() for line in source.splitlines()).strip("\n")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _owner(cls: type, attr: str) -> type:
    for base in cls.__mro__:
        if attr in vars(base):
            return base
    raise LookupError(f"{cls.__module__}.{cls.__qualname__} has no attribute {attr!r}")


@functools.cache
def resolve(cls: type, name: str) -> tuple[str, str]:
    """(qualified name, source digest) of what `name` (see Upstream.names) is for the matched class `cls`."""
    if name.startswith(":"):
        head, *rest = name[1:].split(".")
        namespace = sys.modules[cls.__module__]
        if not hasattr(namespace, head):
            raise LookupError(f"{cls.__module__} has no {head!r}")
        obj = getattr(namespace, head)
        if rest:  # ":Class.attr": through that class's MRO, like a matched class's attribute
            owner = _owner(obj, rest[0])
            obj, qualified = vars(owner)[rest[0]], f"{owner.__module__}.{owner.__qualname__}.{rest[0]}"
        else:
            obj = inspect.unwrap(torch_path(obj))
            qualified = f"{obj.__module__}.{obj.__qualname__}"
    else:
        owner = _owner(cls, name)
        obj, qualified = vars(owner)[name], f"{owner.__module__}.{owner.__qualname__}.{name}"
    obj = inspect.unwrap(getattr(obj, "__func__", obj))  # staticmethod / classmethod, functools.wraps
    return qualified, digest(inspect.getsource(obj))


def _installed() -> str:
    import transformers

    return transformers.__version__


def problem(kind: str, module) -> tuple[str, str] | None:
    """(feature, fix) refusing `module`, matched by `kind`, when upstream code the kind re-implements is not the
    source it was written against; None when it is (or the kind re-implements nothing)."""
    spec = REIMPLEMENTED.get(kind)
    if spec is None:
        return None
    cls = type(module)
    resolved = []
    for name in spec.names:
        try:
            resolved.append((*resolve(cls, name), None))
        except (LookupError, OSError, TypeError) as e:  # gone, renamed, or no source to read
            resolved.append((name, None, f"cannot be read ({e})"))
    for qualified, found, why in resolved:
        if found is not None and found in DIGESTS.get(qualified, {}):
            continue
        versions = sorted({v for q, _, _ in resolved for vs in DIGESTS.get(q, {}).values() for v in vs},
                          key=_version_key)
        written = f"written against transformers {', '.join(versions) or '(none recorded)'}"
        what = f"{cls.__name__}: its {qualified} (transformers {_installed()})"
        return (f"{what} {why}; longdoc's {kind!r} layer kind re-implements it ({written})" if why else
                f"{what} is not the source longdoc's {kind!r} layer kind re-implements (digest {found}; {written})",
                "install the transformers version longdoc was tested with (make install, or pip install -c "
                "constraints.txt), or update longdoc; once its tests pass on this version, record the new source "
                "with `python -m longdoc.hf.upstream --update`")
    return None


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", version))


def current() -> dict[str, str]:
    """qualified name -> source digest of everything REIMPLEMENTED names, in the installed transformers."""
    out = {}
    for spec in REIMPLEMENTED.values():
        for path in spec.classes:
            module, _, qualname = path.rpartition(".")
            cls = getattr(importlib.import_module(module), qualname)
            for name in spec.names:
                qualified, found = resolve(cls, name)
                out[qualified] = found
    return out


def merged(found: dict[str, str], version: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """DIGESTS with the digests `found` on transformers `version` added."""
    table = {q: dict(known) for q, known in DIGESTS.items()}
    for qualified, d in found.items():
        versions = table.setdefault(qualified, {}).get(d, ())
        table[qualified][d] = tuple(sorted({*versions, version}, key=_version_key))
    return table


def render(table: dict[str, dict[str, tuple[str, ...]]]) -> str:
    def q(text: str) -> str:
        return '"' + text + '"'

    lines = ["DIGESTS: dict[str, dict[str, tuple[str, ...]]] = {"]
    for qualified in sorted(table):
        lines.append(f"    {q(qualified)}: {{")
        for d, versions in sorted(table[qualified].items(), key=lambda kv: _version_key(kv[1][0])):
            lines.append(f"        {q(d)}: ({', '.join(map(q, versions))}{',' if len(versions) == 1 else ''}),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m longdoc.hf.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true",
                        help="add the installed transformers' digests to DIGESTS in this file (after the tests pass)")
    args = parser.parse_args(argv)
    version, found = _installed(), current()
    for qualified, d in sorted(found.items()):
        state = "recorded" if d in DIGESTS.get(qualified, {}) else "NEW"
        print(f"{state:8} {d} {qualified}")
    if not args.update:
        return 0
    path = Path(__file__)
    text = path.read_text()
    begin, end = "# BEGIN DIGESTS\n", "# END DIGESTS\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}{render(merged(found, version))}\n{end}{tail}")
    print(f"recorded transformers {version} in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
