"""Per-rank activation memory of each layer kind at cp=2 against one process: a Llama, a Mamba2 hybrid, a Gated
DeltaNet hybrid, DeepSeek's sparse indexed attention (DSA) and a MoE, each a tiny random-init model.

    python -m longdoc.bench.kinds_memory                  # 8k tokens (issue 28's acceptance), exit 1 if a kind misses
    python -m longdoc.bench.kinds_memory --quick          # 256 tokens, all kinds in one process per cp (smoke run)
    longdoc bench kinds --seq-len 8192                    # the same as a section of `longdoc bench`

Each model (hidden 256, two layers: the kind's own layer and, for the hybrids, an attention layer) is patched and
runs one forward+backward on one sequence (labels = input ids) in fresh processes of one thread each (cp=1: one
process; cp=2: two gloo ranks), with no activation checkpointing, so what is measured is the kinds' own
activations. Per rank:
  saved    bytes of the tensors saved for backward (saved-tensor hooks; parameters excluded; each storage once)
  peak     the peak of all tensor bytes alive during the step that the step allocated (a dispatch mode that follows
           every op's output storage until it is freed): saved tensors, temporaries, backward buffers. Gradients
           are allocated before the step and accumulate in place, so they do not count; weights never do.
  RSS      growth of the process's peak resident size (VmHWM, reset before the step) over its size before the step,
           with glibc returning freed memory at once (longdoc.runtime.budgets.return_freed_memory, as longdoc's
           launcher)
Targets (issue 28): cp=2 / cp=1 at most 0.55 for peak tracked bytes and at most 0.65 for RSS (the exit status is 1
when a kind misses one, except with --quick). The largest owners of live bytes at the peak (module or backward node)
and of the saved bytes are kept per run (`top_at_peak`, `top_saved`), to show which terms do not shrink with cp.
The load average (1, 5, 15 min) is recorded before and after; memory does not depend on it, the step times do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from longdoc.runtime.spawn import run_local

TRACKED_TARGET = 0.55
RSS_TARGET = 0.65

# name -> (the kind it stands for, how its config is built below)
MODELS: dict[str, str] = {
    "llama": "attention",
    "granitemoehybrid": "Mamba2 hybrid",
    "qwen3_next": "Gated DeltaNet hybrid",
    "deepseek_v32": "DSA",
    "mixtral": "MoE",
}


@dataclass(kw_only=True)
class KindsMemoryConfig:
    seq_len: int = 8192
    models: tuple[str, ...] = tuple(MODELS)
    ranks: int = 2
    hidden: int = 256
    index_topk: int = 512  # DSA keys per query (at most a quarter of the sequence)
    fresh_processes: bool = True  # one process (group) per model and cp; False: all models in one, faster
    dtype: str = "float32"
    seed: int = 0


QUICK = KindsMemoryConfig(seq_len=256, hidden=64, fresh_processes=False)


def config(name: str, cfg: KindsMemoryConfig):
    """The model config of one MODELS entry at the bench's size."""
    from transformers import AutoConfig

    from longdoc.models import tiny_config

    h = cfg.hidden
    shape = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=h // 4, vocab_size=256, max_position_embeddings=max(4096, cfg.seq_len))
    if name == "llama":
        return tiny_config("llama", **shape)
    if name == "mixtral":
        return tiny_config("mixtral", **shape, num_local_experts=4, num_experts_per_tok=2)
    if name == "granitemoehybrid":  # Granite 4.0-H: Mamba2 (SSD) + attention, MoE MLPs
        return tiny_config("granitemoehybrid", **shape, layer_types=["mamba", "attention"], mamba_n_heads=8,
                           mamba_d_head=2 * h // 8, mamba_n_groups=1, mamba_d_state=32, mamba_chunk_size=64,
                           shared_intermediate_size=h)
    if name == "deepseek_v32":  # MLA + the lightning indexer's top-k; a dense and a MoE MLP
        return tiny_config("deepseek_v32", **{**shape, "num_key_value_heads": 4, "head_dim": 16},
                           mlp_layer_types=["dense", "sparse"], index_topk=min(cfg.index_topk, cfg.seq_len // 4),
                           index_n_heads=4, index_head_dim=64, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                           qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=h, n_routed_experts=4)
    if name == "qwen3_next":  # Qwen3-Next: Gated DeltaNet + gated attention, MoE MLPs (no tiny: name in the zoo)
        config = AutoConfig.for_model(
            "qwen3_next", **shape, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=h // 4, linear_value_head_dim=h // 4,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=h,
            shared_expert_intermediate_size=h, decoder_sparse_step=1, tie_word_embeddings=False)
        for key, value in vars(config).items():
            if key.endswith("dropout") and isinstance(value, float):
                setattr(config, key, 0.0)
        return config
    raise ValueError(f"unknown model {name!r}; choose among {', '.join(MODELS)}")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops allocate while active, alive at each moment, and their peak; each
    storage is followed until it is freed. The owner of each storage is the innermost module running (forward) or
    the backward node (backward); `at_peak` is the live bytes per owner when the peak was last raised."""

    def __init__(self, ignore: list[torch.Tensor], owner: Callable[[], str]):
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in ignore:
            self._seen[t.untyped_storage()] = None
        self._owner = owner
        self.live = self.peak = 0
        self.by_owner: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self._snapshot_at = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        if storage in self._seen:
            return
        n, who = storage.nbytes(), self._owner()
        self._seen[storage] = n
        self.live += n
        self.by_owner[who] = self.by_owner.get(who, 0) + n
        weakref.finalize(storage, self._free, n, who)
        if self.live > self.peak:
            self.peak = self.live
            if self.peak - self._snapshot_at > max(2**20, self.peak // 100):  # copies of the table, not per op
                self.at_peak, self._snapshot_at = dict(self.by_owner), self.peak

    def _free(self, n: int, who: str) -> None:
        self.live -= n
        self.by_owner[who] -= n


def _top(table: dict[str, int], n: int = 8) -> dict[str, int]:
    return dict(sorted(((k, v) for k, v in table.items() if v > 0), key=lambda kv: -kv[1])[:n])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_step(model, batch: dict) -> dict:
    """One forward+backward of `model` on `batch`, counted (module docstring): saved, peak and RSS bytes."""
    import gc

    from longdoc.train.metrics import PeakMemory

    names = {m: n or "(root)" for n, m in model.named_modules()}
    stack: list[str] = []
    params = list(model.parameters())
    for p in params:  # gradients exist before the step, so backward adds into them in place (not counted)
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    ignore = params + [p.grad for p in params if p.grad is not None] + list(model.buffers()) + list(batch.values())

    def owner() -> str:
        node = torch._C._current_autograd_node()
        return f"backward {node.name()}" if node is not None else (stack[-1] if stack else "(outside modules)")

    live = LiveBytes(ignore, owner)
    saved: dict[int, tuple[int, str]] = {}
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = (t.untyped_storage().nbytes(), owner())
        return t

    modules = torch.nn.modules.module
    hooks = [modules.register_module_forward_pre_hook(lambda m, a: stack.append(names.get(m) or type(m).__name__)),
             modules.register_module_forward_hook(lambda m, a, o: stack.pop() and None)]
    gc.collect()
    peak = PeakMemory(torch.device("cpu"))
    rss_before = _rss_bytes()
    peak.reset()
    start = time.perf_counter()
    try:
        with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
            saved_bytes, live_after_forward = sum(n for n, _ in saved.values()), live.live
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    seconds = time.perf_counter() - start
    rss_growth = int(peak.peak_gb() * 2**30) - rss_before
    by_owner: dict[str, int] = {}
    for n, who in saved.values():
        by_owner[who] = by_owner.get(who, 0) + n
    return {"saved_bytes": saved_bytes, "live_after_forward": live_after_forward, "peak_bytes": live.peak,
            "rss_growth_bytes": rss_growth, "rss_before_bytes": rss_before, "step_s": seconds,
            "top_saved": _top(by_owner), "top_at_peak": _top(live.at_peak),
            "param_bytes": sum(p.numel() * p.element_size() for p in params)}


def _rank(rank: int, world_size: int, cfg: KindsMemoryConfig, names: tuple[str, ...]) -> list[dict]:
    """Every model of `names` in turn on this rank: patched, one counted step on this rank's part of the sequence."""
    import longdoc
    from longdoc import models

    cp = longdoc.ContextParallel(timeout=3600)
    out = []
    for name in names:
        model = models.from_config(config(name, cfg), seed=cfg.seed, dtype=getattr(torch, cfg.dtype))
        model.config.use_cache = False
        longdoc.patch(model.train(), cp)
        ids = torch.randint(0, 256, (1, cfg.seq_len), generator=torch.Generator().manual_seed(cfg.seed))
        out.append(measure_step(model, cp.shard_batch({"input_ids": ids, "labels": ids.clone()})))
        del model
    return out


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [-1.0, -1.0, -1.0]


def run(cfg: KindsMemoryConfig, log=print) -> dict:
    """cp=1 and cp=`ranks` per model; the ratios (largest rank / one process) and whether they meet the targets."""
    unknown = [n for n in cfg.models if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose among {', '.join(MODELS)}")
    load_start = _load()
    groups = [(n,) for n in cfg.models] if cfg.fresh_processes else [tuple(cfg.models)]
    per: dict[int, dict[str, list[dict]]] = {1: {}, cfg.ranks: {}}
    for names in groups:
        for world in (1, cfg.ranks):
            ranks = run_local(world, _rank, cfg, names, threads=1, deadline=7200, pg_timeout=3600)
            for i, name in enumerate(names):
                per[world][name] = [r[i] for r in ranks]
                m = max(r[i]["peak_bytes"] for r in ranks)
                log(f"kinds-memory: {name} cp={world}: peak {m / 2**20:.1f} MiB, "
                    f"{max(r[i]['step_s'] for r in ranks):.1f} s")
    rows = []
    for name in cfg.models:
        one, cp = per[1][name][0], per[cfg.ranks][name]
        worst = {k: max(r[k] for r in cp) for k in ("saved_bytes", "peak_bytes", "rss_growth_bytes")}
        ratios = {k.removesuffix("_bytes"): worst[k] / one[k] if one[k] > 0 else math.nan for k in worst}
        rows.append({"model": name, "kind": MODELS[name], "cp1": one, "cp": cp, "cp_max": worst, "ratios": ratios,
                     "meets_tracked": ratios["peak"] <= TRACKED_TARGET,
                     "meets_rss": ratios["rss_growth"] <= RSS_TARGET})
    load_end = _load()
    return {"config": asdict(cfg), "targets": {"tracked": TRACKED_TARGET, "rss": RSS_TARGET}, "rows": rows,
            "passed": all(r["meets_tracked"] and r["meets_rss"] for r in rows),
            "load_start": load_start[0], "load_end": load_end[0], "loadavg_start": load_start, "loadavg_end": load_end}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def to_markdown(res: dict) -> str:
    c, n = res["config"], res["config"]["ranks"]
    lines = [f"Tiny models (hidden {c['hidden']}, 2 layers), {c['seq_len']:,} tokens, {c['dtype']}, one "
             f"forward+backward without checkpointing; cp=1 (1 process) vs cp={n} (largest rank); MiB per process. "
             f"Load average {res['load_start']:.2f} -> {res['load_end']:.2f}. Targets: tracked peak <= "
             f"{res['targets']['tracked']}x, RSS growth <= {res['targets']['rss']}x.", "",
             f"| model | kind | saved cp=1 | saved cp={n} | ratio | tracked peak cp=1 | cp={n} | ratio | "
             f"RSS cp=1 | RSS cp={n} | ratio | meets |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        one, cp, q = r["cp1"], r["cp_max"], r["ratios"]
        missed = [w for w, ok in (("tracked", r["meets_tracked"]), ("RSS", r["meets_rss"])) if not ok]
        verdict = f"no ({', '.join(missed)})" if missed else "yes"
        lines.append(f"| {r['model']} | {r['kind']} | {_mib(one['saved_bytes'])} | {_mib(cp['saved_bytes'])} | "
                     f"{q['saved']:.3f} | {_mib(one['peak_bytes'])} | {_mib(cp['peak_bytes'])} | {q['peak']:.3f} | "
                     f"{_mib(one['rss_growth_bytes'])} | {_mib(cp['rss_growth_bytes'])} | {q['rss_growth']:.3f} | "
                     f"{verdict} |")
    lines += ["", "All kinds meet the targets." if res["passed"] else "**Some kinds miss the targets** (see the "
              "`top_at_peak` owners in the JSON for what does not shrink)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m longdoc.bench.kinds_memory", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 tokens, hidden 64, one process per cp (a smoke run; "
                   "the targets are not checked)")
    p.add_argument("--seq-len", type=int, help="tokens of the one sequence (default 8192)")
    p.add_argument("--models", help=f"comma-separated, among {', '.join(MODELS)} (default: all)")
    p.add_argument("--ranks", type=int, help="CP size compared with one process (default 2)")
    p.add_argument("--fresh-processes", action=argparse.BooleanOptionalAction, default=None,
                   help="a fresh process (group) per model and cp (default; --quick: all models in one process per "
                        "cp, which saves the start-up of 8 processes)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else KindsMemoryConfig()
    given = {"seq_len": args.seq_len, "ranks": args.ranks, "fresh_processes": args.fresh_processes,
             "models": tuple(args.models.split(",")) if args.models else None}
    cfg = KindsMemoryConfig(**{**asdict(cfg), **{k: v for k, v in given.items() if v is not None}})
    res = run(cfg)
    print(to_markdown(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["passed"] or args.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
