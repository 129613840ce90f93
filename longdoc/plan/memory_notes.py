"""What a memory estimate prices roughly or not at all, and what it assumes, in words: the notes `longdoc plan`
prints under the numbers (`longdoc.plan.memory.estimate`)."""

from __future__ import annotations

from longdoc.parallel.layout import num_chunks
from longdoc.plan import layer_activations
from longdoc.plan.hardware import GIB
from longdoc.plan.setups import Setup
from longdoc.plan.shapes import MODELLED_MIXERS


def notes(s: Setup, by_kind: bool) -> list[str]:
    """The notes of `s`'s estimate; by_kind: some layer is priced by longdoc.plan.layer_activations, not as a
    Llama-style one."""
    out, sh = [], s.shape
    if sh.experts is not None:
        out.append("MoE layers: the router, the k routed copies of each token through the experts and the shared "
                     "experts are priced as they are saved (longdoc/plan/layer_activations.py); the forward and "
                     f"backward temporaries use the widest MLP a token passes, I = {sh.intermediate:,} (k*expert + "
                     f"shared, or a dense layer's)")
    if s.shape.max_positions and s.seq_len > s.shape.max_positions:
        out.append(f"seq_len {s.seq_len} exceeds the model's context ({s.shape.max_positions}); train with "
                     f"model.rope_type=yarn and a rope_factor")
    modelled = sorted({sh.mixer(j) for j in range(sh.layers)} & MODELLED_MIXERS)
    if modelled:
        out.append(f"hybrid model ({', '.join(modelled)} layers): the chunked scans' saved intermediates, conv "
                     f"halos and this rank's state summaries are priced per layer "
                     f"(longdoc/plan/layer_activations.py), one document per row (packed rows run more pieces); the "
                     f"scans' backward temporaries are not modelled (every layer is given the attention backward's "
                     f"workspace)")
    unmodelled = sorted({sh.mixer(j) for j in range(sh.layers)} - MODELLED_MIXERS - {"attention"})
    if not sh.layer_kinds and sh.mixers:
        unmodelled = list(sh.mixers)
    if unmodelled:
        out.append(f"not modelled yet, priced as attention layers: {'; '.join(unmodelled)} (state summaries, "
                     f"halos, scan intermediates); measure them (`longdoc bench kinds`, a short `longdoc train` run)")
    if sh.indexer is not None:
        out.append(f"sparse indexed attention (DSA): its int32 top-k indices (saved), the indexer's keys of the "
                     f"whole sequence with one {4 * layer_activations.DSA_SCORE_ELEMENTS // 2**20} MiB score tile "
                     f"(forward) and "
                     f"the selected-key mask tile (backward) are priced; its attention FLOPs as dense causal attention")
    if (s.lora or s.dev.autocast) and by_kind:
        out.append("LoRA / CPU autocast are modelled for attention layers with dense MLPs; the other kinds' "
                     "layers (recurrent mixers, MoE, MLA) are priced with their full fine-tuning terms")
    if s.offloads:
        host = s.shape.layers * s.tokens * s.shape.hidden * s.c
        out.append(f"offloaded layer checkpoints take {host / GIB:.1f} GiB of (pinned) host memory per rank")
    elif s.offload:
        out.append("offload on a CPU: host memory is the device's, so the checkpoints weigh the same")
    if s.padded_len != s.seq_len:
        out.append(f"the sequence is padded from {s.seq_len} to {s.padded_len} tokens (a multiple of "
                     f"{num_chunks(s.layout, s.cp)})")
    return out
