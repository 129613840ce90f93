"""Text renderings of plans (`longdoc plan` without --json)."""

from __future__ import annotations

from longdoc.plan.hardware import GIB
from longdoc.plan.planner import Candidate, Plan, PlanRequest, strategy_label


def _gib(x: float) -> str:
    return f"{x / GIB:7.2f}"


def _tokens(x: float) -> str:
    return f"{x:,.0f}"


def render_candidate(c: Candidate) -> list[str]:
    m, t = c.memory, c.time
    phase = {"forward": "the end of the forward", "loss": "the loss backward",
             "backward": "the backward of a decoder layer", "optimizer": "the optimizer step"}[m.peak_phase]
    lines = [f"  peak per {'rank' if not c.setup.dev.is_gpu else 'GPU'}: {m.total_gib:.2f} GiB of "
             f"{c.capacity_gib:.2f} GiB, during {phase}",
             f"  {'term':<58} {'GiB':>7}  formula (bytes)"]
    for term in m.terms:
        lines.append(f"  {term.label:<58} {_gib(term.bytes)}  {term.formula}")
    lines.append("  by category: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.breakdown.items() if v))
    lines.append("  phases: " + ", ".join(f"{k} {m.phase_total(k) / GIB:.2f}" for k in m.phases) + " GiB")
    lines.append(f"  step time: {t.total:.2f} s = compute {t.seconds['compute']:.2f} + exposed communication "
                 f"{t.seconds['exposed_comm']:.2f} + optimizer {t.seconds['optimizer']:.3f}; "
                 f"{_tokens(t.tokens_per_s)} tokens/s ({_tokens(t.tokens_per_s_per_device)} per GPU)")
    lines.append("  FLOPs per rank: " + ", ".join(f"{k} {v:.3g}" for k, v in t.flops.items())
                 + "; bytes sent per rank: " + (", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in t.comm_bytes.items())
                                                or "none"))
    lines += [f"  note: {n}" for n in m.notes]
    return lines


def _precision_line(r: PlanRequest) -> str:
    if r.dev.is_gpu:
        return "precision: bf16 compute (fp32 master weights and gradients)"
    if r.precision == "bf16":
        return ("precision: bf16 autocast over fp32 weights (train.mixed_precision: bf16; what 'auto' picks on a CPU "
                "with native bf16; --precision fp32 plans an fp32 run)")
    return "precision: fp32 (train.mixed_precision: no; --precision bf16 plans a bf16-autocast run)"


def render_plan(p: Plan, show_all: bool = False) -> str:
    r, sh = p.request, p.shape
    dev = r.dev
    head = (f"longdoc plan: {sh.name} ({sh.params.total / 1e9:.2f}B params, {sh.layers} layers, hidden {sh.hidden}, "
            f"{sh.heads}/{sh.kv_heads} heads x {sh.head_dim}, vocab {sh.vocab:,}) at {r.seq_len:,} tokens "
            f"x {r.micro_batch} on {r.gpus} x {dev.name}" + (f" ({r.interconnect})" if dev.is_gpu else ""))
    kinds = sorted({f"{sh.mixer(j)} + {sh.mlp(j)}" for j in range(sh.layers)})
    if len(kinds) > 1 or sh.experts is not None or sh.layer_kinds:
        counts = {k: sum(1 for j in range(sh.layers) if f"{sh.mixer(j)} + {sh.mlp(j)}" == k) for k in kinds}
        head += "\nlayers: " + ", ".join(f"{n} x {k}" for k, n in counts.items())
    lines = [head, _precision_line(r), ""]
    if p.best is not None:
        lines.append(f"RECOMMENDED: {p.best.describe()}")
        lines.append(f"  why: {p.reason}")
        lines += render_candidate(p.best)
    else:
        lines.append("DOES NOT FIT: no configuration the options allow fits in "
                     f"{r.capacity_gib:.2f} GiB per device.")
        lines += [f"  - {s}" for s in p.suggestions]
        lines += ["", f"closest: {p.closest.describe()}"] + render_candidate(p.closest)
    rows = p.candidates if show_all else [c for c in p.candidates if c.fits] or p.candidates
    if p.best is not None:
        lines += ["", f"  recipe: {p.best.recipe_keys()}"]
    lines += ["", f"{'cp':>3} {'dp':>3} {'strategy':<10} {'AC':<3} {'offload':<7} {'tiled':<5} {'fsdp':<4} "
                  f"{'peak GiB':>9} {'fits':<4} {'s/step':>8} {'tokens/s':>10} {'per GPU':>8}"]

    def onoff(flag: bool) -> str:
        return "on" if flag else "off"

    for c in sorted(rows, key=lambda c: (c.setup.cp, c.setup.strategy, c.setup.ulysses_size or 0,
                                         c.setup.checkpointing, c.setup.offload, c.setup.tiled_mlp)):
        s = c.setup
        lines.append(f"{s.cp:>3} {s.dp:>3} {strategy_label(s):<10} {onoff(s.checkpointing):<3} {onoff(s.offload):<7} "
                     f"{onoff(s.tiled_mlp):<5} {onoff(s.uses_fsdp):<4} {c.memory.total_gib:>9.2f} "
                     f"{'yes' if c.fits else 'no':<4} {c.time.total:>8.2f} "
                     f"{_tokens(c.time.tokens_per_s):>10} {_tokens(c.time.tokens_per_s_per_device):>8}")
    lines += ["", "Memory formulas: longdoc/plan/memory.py; time: longdoc/plan/timing.py and strategies.py (assumed "
                  "efficiencies: matmul 55%, attention 30%, links 80% of peak)."]
    if dev.is_gpu:
        lines.append("GPU figures are formulas (vendor peaks x the assumed efficiencies), not yet measured on a "
                     "device.")
    else:
        lines.append("CPU figures: the measured rate of this project's CPU kernels and gloo links (hardware.py; "
                     "measured against runs in docs/guides/planning.md).")
    return "\n".join(lines)
