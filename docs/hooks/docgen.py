"""Generated documentation content: the supported-models page from the tests' family lists and the performance
tables from docs/bench/*.json, so a model list or a measured number is never typed by hand.

    python docs/hooks/docgen.py models         # print the generated supported-models markdown
    python docs/hooks/docgen.py performance    # print the generated performance tables
    python docs/hooks/docgen.py refresh        # rewrite the generated blocks of README.md and docs/development.md
    python docs/hooks/docgen.py check          # exit 1 if one of those blocks is stale (`make docs` runs it)

mkdocs runs this file as a hook (mkdocs.yml `hooks:`): a page's `<!-- docgen:NAME -->` line is replaced by block
NAME at build time, so the site always shows what the files in the checkout say. The files read outside the site too
(FILES) hold their blocks between `<!-- docgen:NAME:start -->` and `<!-- docgen:NAME:end -->`, written by `refresh`
and rendered afresh in the site. Sources are found by pattern, so files that land later are picked up without
editing this file:
  - tests/support/hf_*.py with a module-level FAMILIES or HYBRIDS dict (model_type -> overrides; a trailing comment on
    the entry's line says what the family brings), read with `ast` (nothing is imported or built);
  - longdoc/models/zoo.py PLAIN and PATTERNED (the `tiny:` names the CLI builds);
  - docs/models/*.json written by tests/support/survey.py (every causal-LM type of the installed transformers);
  - longdoc/**/*.py: the module docstrings, for the module map (docs/hooks/modulemap.py);
  - docs/bench/*.json: a `longdoc bench` suite result (rendered by longdoc.bench.suite.to_markdown, the same
    renderer as `longdoc bench`; `longdoc bench --publish docs/bench` writes it) or a single section result
    (patterns.json), and docs/bench/*.png.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- docgen:([a-z-]+) -->$", re.M)
FILE_BLOCK = re.compile(r"(<!-- docgen:([a-z-]+):start -->\n)(.*?)(<!-- docgen:\2:end -->)", re.S)

# What each family list is, in page order (a list not named here is titled by its file name and comes last).
LISTS = {
    "hf_families.py": "Attention patterns: sliding windows, sinks, soft-capping, chunked attention",
    "hf_dsa.py": "Sparse attention: DeepSeek sparse attention (the indexer's top-k)",
    "hf_hybrids.py": "Hybrid state-space models: Mamba1/2, short convolutions, ZAYA's CCA, alone or beside attention",
    "hf_hybrids_linear.py": "Linear attention and RNN layers: Gated DeltaNet, KDA, lightning, RG-LRU, RWKV, mLSTM",
}
# The module-level dicts a family list may be called (model_type -> overrides, or (overrides, how)).
LIST_NAMES = ("FAMILIES", "HYBRIDS")


def _family_lists() -> list[tuple[Path, list[tuple[str, str]], list[str]]]:
    """(file, [(model_type, what it exercises)], the distributed tests that run it) for every tests/support/hf_*.py with
    a family list that some distributed test imports (a list no distributed test runs proves nothing); in LISTS
    order, then by file name."""
    order = list(LISTS)
    paths = sorted((ROOT / "tests" / "support").glob("hf_*.py"),
                   key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))
    out = []
    for path in paths:
        entries = _dict_entries(path, LIST_NAMES)
        rows = next((entries[n] for n in LIST_NAMES if entries.get(n)), [])
        tests = _tests_using(path.stem)
        if rows and tests:
            out.append((path, rows, tests))
    return out


def _tests_using(module: str) -> list[str]:
    """The distributed tests (CP ranks vs the single-process reference) that import tests/support/<module>.py."""
    return _tests_matching(rf"^from tests\.support\.{module} import|^import tests\.support\.{module}")


def _tests_matching(regex: str) -> list[str]:
    pattern = re.compile(regex, re.M)
    return [f"tests/dist/{p.name}" for p in sorted((ROOT / "tests" / "dist").glob("test_*.py"))
            if pattern.search(p.read_text())]


# Config keys (or the tests' shared override names) -> the feature a family's tiny config turns on.
FEATURES = [(r"sliding_window|_SLIDING|local_attention", "sliding window"), (r"softcapping", "soft-capping"),
            (r"attention_chunk_size", "chunked attention"), (r"no_rope_layers", "NoPE layers"),
            (r"_MOE|num_local_experts|num_experts", "MoE"), (r"_MAMBA|mamba|state_size", "state-space layers"),
            (r"conv_L_cache|\"conv\"", "short convolutions"), (r"_GDN|linear_", "linear attention"),
            (r"_MLA|kv_lora_rank", "MLA"), (r"indexer|index_topk", "sparse indexer"),
            (r"num_kv_shared_layers", "shared KV layers"), (r"lru_width", "RG-LRU recurrence"),
            (r"attention_window_size", "local attention"), (r"attention_hidden_size", "WKV recurrence"),
            (r"\bblock_size", "lightning attention blocks"), (r"qk_dim_factor", "mLSTM")]


def _features(source: str) -> str:
    return ", ".join(name for pattern, name in FEATURES if re.search(pattern, source))


def _dict_entries(path: Path, names: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
    """{dict name: [(key, what it exercises)]} for the module-level string-keyed dicts called `names`: the
    trailing comment on the entry's last line, else the features its config overrides name."""
    src = path.read_text()
    lines = src.splitlines()
    out: dict[str, list[tuple[str, str]]] = {}
    tree = ast.parse(src)
    # what every entry of the file shares (its _COMMON config), for an entry that names nothing of its own
    shared = next((_features(ast.unparse(n.value)) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                   and n.value is not None and "_COMMON" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign)
                                                                          else n.target)), "")
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not isinstance(target, ast.Name) or target.id not in names or not isinstance(node.value, ast.Dict):
            continue
        rows = []
        for key, value in zip(node.value.keys, node.value.values):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                continue
            end = lines[(value.end_lineno or key.lineno) - 1]
            comment = end.split("#", 1)[1].strip() if "#" in end and not end.lstrip().startswith("#") else ""
            rows.append((key.value, comment or _features(ast.unparse(value))
                         or (f"the list's shared config ({shared})" if shared else "")))
        out[target.id] = rows
    return out


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def models() -> str:
    parts = ["Generated by `python docs/hooks/docgen.py models` from the tests' family lists; every family below "
             "is run under context parallelism by the named test and compared with the single-process reference "
             "(outputs and gradients)."]
    zoo = _dict_entries(ROOT / "longdoc" / "models" / "zoo.py", ("PLAIN", "PATTERNED"))
    plain = [k for k, _ in zoo.get("PLAIN", [])]
    parts += ["", "### Plain causal LMs (full attention)", "",
              f"Run by {', '.join(_tests_matching(r'TINY_ARCHS'))} "
              "(`tiny:<name>` in the CLI): " + ", ".join(f"`{k}`" for k in plain)
              + ". Any model whose attention goes through transformers' attention interface with full causal "
              "attention is in this class (`longdoc verify MODEL` checks one)."]
    total = len(plain)
    for path, rows, tests in _family_lists():
        total += len(rows)
        parts += ["", f"### {LISTS.get(path.name, f'Families of tests/support/{path.name}')}", "",
                  f"{len(rows)} families in tests/support/{path.name}, run by {', '.join(tests)}.", "",
                  "| model_type | what it exercises |", "|---|---|"]
        parts += [f"| `{k}` | {_md_escape(c) or '-'} |" for k, c in rows]
    patterned = zoo.get("PATTERNED", [])
    if patterned:
        parts += ["", "### Tiny models for the CLI", "", "`tiny:<name>` builds a random-init model of these (no "
                  "download): " + ", ".join(f"`tiny:{k}`" for k in plain + [k for k, _ in patterned]) + "."]
    for path in sorted((ROOT / "docs" / "models").glob("*.json")):
        parts += ["", _survey(path)]
    parts.insert(1, f"\n**{total} model families** are tested.")
    return "\n".join(parts)


def _survey(path: Path) -> str:
    rec = json.loads(path.read_text())
    types = rec.get("types", {})
    when = f", {rec['date']}" if rec.get("date") else ""
    counts = ", ".join(f"{v} {k}" for k, v in sorted(rec.get("counts", {}).items()))
    head = [f"### Survey: every causal-LM type of the installed transformers ({path.name})", "",
            f"Written by `python -m tests.support.survey` (transformers {rec.get('transformers', '?')}, "
            f"cp={rec.get('cp', '?')}{when}): {counts}.", "", "| model_type | status | detail |", "|---|---|---|"]
    return "\n".join(head + [f"| `{t}` | {r.get('status')} | {_md_escape(str(r.get('detail', ''))[:160])} |"
                             for t, r in sorted(types.items())])


def _bench_files() -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted((ROOT / "docs" / "bench").glob("*.json"))]


def performance() -> str:
    from longdoc.bench import patterns, suite

    parts = []
    for path, data in _bench_files():
        if "sections" in data:
            parts += [f"### Suite run: docs/bench/{path.name}", "", suite.to_markdown(data)]
        elif {"median_s", "ratios"} <= set(data):
            parts += [f"### Attention patterns run: docs/bench/{path.name}", "", patterns.to_markdown(data)]
        elif "tile_tokens" in data:
            from longdoc.bench import tiled_mlp

            parts += [f"### Tiled MLP step-time cost: docs/bench/{path.name}", "", tiled_mlp.to_markdown(data)]
        elif {"median_s", "ratio"} <= set(data) and "two-sequence" in data["median_s"]:
            from longdoc.bench import dpo_step

            parts += [f"### DPO step, shared prompt vs two sequences: docs/bench/{path.name}", "",
                      dpo_step.to_markdown(data)]
        elif data.get("kind") == "gpu-check":
            parts += [f"### GPU check: docs/bench/{path.name}", "", gpu_check_markdown(data)]
        elif data.get("kind") == "longest-matrix":
            parts += [f"### Longest sequence per memory feature: docs/bench/{path.name}", "",
                      "Rendered with its plot under \"Longest trainable sequence per memory feature\" above."]
        else:
            parts += [f"### docs/bench/{path.name}", "", "(no renderer for this file's format)"]
        parts.append("")
    pngs = sorted((ROOT / "docs" / "bench").glob("*.png"))
    if pngs:
        parts += ["### Plots", ""] + [f"![{p.stem}](bench/{p.name})" for p in pngs]
    return "\n".join(parts)


def _newest_matrix() -> tuple[Path, dict, Path] | None:
    """(file, matrix, plot) of the newest published `longdoc bench longest` matrix, or None."""
    found = []
    for path, data in _bench_files():
        section = (data.get("sections") or {}).get("longest") or {}
        if data.get("kind") == "longest-matrix":
            found.append((data["started"], path, data, path.with_suffix(".png")))
        elif section.get("kind") == "longest-matrix":
            found.append((section["started"], path, section, path.parent / "longest_matrix.png"))
    return max(found, key=lambda f: f[0])[1:] if found else None


def longest_matrix() -> str:
    """The newest published `longdoc bench longest` matrix (docs/bench/longest-matrix-*.json beside its .png, or the
    longest section of a published suite run), or a line saying none is published yet."""
    from longdoc.bench import longest

    newest = _newest_matrix()
    if newest is None:
        return ("Not measured yet: no `longdoc bench longest` result is published in docs/bench (the matrix is "
                "published as `longest-matrix-DATE.json` with its `.png`).")
    path, data, png = newest
    parts = [f"From docs/bench/{path.name}:", "", longest.to_markdown(data)]
    if png.is_file():
        parts += ["", f"![longest sequence per memory feature](bench/{png.name})"]
    return "\n".join(parts)


def gpu_check_markdown(data: dict) -> str:
    """`make gpu-check`'s file (longdoc/bench/gpucheck.py): each part's status, and the step's peak vs the planner."""
    lines = [f"{data.get('device')}, torch {data.get('torch')}, {data.get('date')}"
             f"{' (dry run)' if data.get('dry_run') else ''}; {data.get('seconds', 0):.0f} s.", "",
             "| part | status | detail |", "|---|---|---|"]
    for part in ("tests", "kernels", "step"):
        rec = data.get(part, {})
        detail = rec.get("why") or ", ".join(f"{n} {k}" for k, n in rec.get("counts", {}).items())
        lines.append(f"| {part} | {rec.get('status', '?')} | {detail} |")
    step = data.get("step", {})
    runs = [r for r in step.get("runs", []) if "step_s" in r]
    if runs:
        lines += ["", f"Full fine-tuning step, {step.get('model')} at {step.get('seq_len'):,} tokens "
                      f"(planner without offload: peak {step.get('predicted_peak_gib', float('nan')):.2f} GiB, "
                      f"{step.get('predicted_step_s', float('nan')):.2f} s):", "",
                  "| offload | step s | peak GiB | predicted GiB | peak / predicted |", "|---|---:|---:|---:|---:|"]
        for r in runs:
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
            predicted = f"{r['predicted_peak_gib']:.2f}" if "predicted_peak_gib" in r else "-"
            ratio = f"{r['peak_vs_predicted']:.3f}" if "peak_vs_predicted" in r else "-"
            lines.append(f"| {'on' if r['offload'] else 'off'} | {r['step_s']:.2f} | {peak} | {predicted} | {ratio} |")
    return "\n".join(lines)


def _suite() -> dict:
    """The published suite results merged, each section from the newest run that has it (bench.json is the last
    full run; a later run of some sections, such as `longdoc bench attention hybrid dsa`, is published beside it
    under its own name), with the dates of the runs used."""
    runs = sorted((data for _, data in _bench_files() if "sections" in data), key=lambda d: d.get("started", ""))
    if not runs:
        raise FileNotFoundError("no longdoc bench suite result (a json with 'sections') under docs/bench/")
    sections, dates = {}, {}
    for data in runs:
        for name, value in data["sections"].items():
            sections[name] = value
            dates[name] = data.get("started", "?")[:10]
    return {"machine": runs[-1]["machine"], "sections": sections, "dates": sorted(set(dates.values()))}


def headline(performance_page: str = "performance.md") -> str:
    """The headline numbers, computed from the suite result (so they are not typed by hand)."""
    s = _suite()
    sec = s["sections"]
    lines = [f"Measured by `make bench` on {s['machine'].get('cpus')} CPU cores ({', '.join(s['dates'])}; full tables "
             f"and plots: [performance]({performance_page})):", ""]
    att = sec.get("attention") or {}
    for n, run in list(zip(att.get("lengths", []), att.get("runs", [])))[-1:]:
        q, ranks = run["ratios"], run["config"]["ranks"]
        lines.append(f"- attention fwd+bwd at {n:,} tokens, {ranks} ranks x 1 thread vs 1 process x {ranks} threads "
                     f"(SDPA): CP efficiency E = {q['E']:.2f}, zigzag {q['Z']:.2f}x faster than the contiguous layout"
                     + (f"; Ulysses E = {q['E_ulysses']:.2f}" if "E_ulysses" in q else ""))
    hyb = sec.get("hybrid")
    if hyb:
        c, per_layer = hyb["config"], hyb.get("bytes_per_layer") or {}
        moved = ", ".join(f"{k} {v / 1024:,.0f} KiB" for k, v in per_layer.items())
        lines.append(f"- hybrid model (Granite-4.0-H shape, {c['layers']} layers, Mamba2 + attention) fwd+bwd at "
                     f"{c['seq_len']:,} tokens: CP efficiency E = {hyb['E']:.2f}, peak {hyb['cp_peak_gib']:.2f} vs "
                     f"{hyb['single_peak_gib']:.2f} GiB per process" + (f"; per layer a rank receives {moved}"
                                                                        if moved else ""))
    sparse = sec.get("dsa")
    if sparse:
        c, r = sparse["config"], sparse["ratios"]
        lines.append(f"- DSA sparse attention (tiny DeepSeek-V3.2 shape) fwd+bwd at {c['seq_len']:,} tokens, "
                     f"index_topk {c['index_topk']:,}: cp={c['ranks']} {r['speedup_dsa']:.2f}x one process "
                     f"(transformers' eager path), peak "
                     f"memory {r['memory_dsa']:.2f}x; DSA {r['dsa_vs_dense_cp']:.2f}x the time of dense causal")
    train = sec.get("train") or []
    for model in dict.fromkeys(r["model"] for r in train):
        one = [r for r in train if r["model"] == model]
        by_cp = {r["cp"]: r for r in one}
        if 1 in by_cp and 2 in by_cp:
            lines.append(f"- training step, {model} at {by_cp[2]['seq_len']:,} tokens: cp=2 "
                         f"{by_cp[2]['tokens_per_s'] / by_cp[1]['tokens_per_s']:.2f}x the tokens/s of cp=1 at equal "
                         f"cores, peak {by_cp[2]['peak_gib']:.2f} vs {by_cp[1]['peak_gib']:.2f} GiB per rank")
    longest = sec.get("longest") or {}
    if longest.get("rows"):
        lines.append(f"- longest training sequence under a {longest['cap_gib']} GiB per-process cap: "
                     + ", ".join(f"{r['measured_longest']:,} tokens at cp={r['cp']}" for r in longest["rows"]))
    newest = _newest_matrix()
    if newest is not None:
        from longdoc.bench import longest as matrix

        data = newest[1]
        measured = [r for r in data["cells"] if r["status"] == "measured"]
        worst = max((abs(r["planner"]["error"]) for r in measured), default=0.0)
        lines.append(f"- longest training sequence under {data['config']['cap_gib']:g} GiB per process "
                     f"({data['config']['precision']}; the planner at full depth, checked within {worst:.1%} against "
                     f"{len(measured)} measured reduced-depth runs, {newest[0].name}): "
                     + "; ".join(x.removeprefix("- ") for x in matrix.summary(data)))
    kinds = sec.get("kinds")
    if kinds and kinds.get("rows"):
        c = kinds["config"]
        per = ", ".join(f"{r['kind']} {r['ratios']['peak']:.2f} / {r['ratios']['rss_growth']:.2f}"
                        for r in kinds["rows"])
        lines.append(f"- per-rank memory of one fwd+bwd at {c['seq_len']:,} tokens, cp={c['ranks']} vs one process "
                     f"(tracked peak / RSS growth): {per}")
    cal = [r for r in sec.get("calibration") or [] if r.get("calibrated", True)]
    if cal:
        worst = max(abs(r["error"]) for r in cal)
        lines.append(f"- memory planner: within {worst:.1%} of the measured peak in all {len(cal)} runs")
    return "\n".join(lines)


def outcomes(prefix: str = "") -> str:
    """Base vs fine-tuned on held-out documents, from the committed `longdoc eval compare` results."""
    lines = []
    for name, what in (("demo", "`make demo`"),
                       ("outcome", "the outcome run (recipes/cpu-legal-qa.yaml)")):
        path = ROOT / "docs" / name / "results.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        qa = rec.get("qa", {}).get("overall", {})
        n = rec.get("qa", {}).get("paired", {}).get("f1", {}).get("n", "?")
        if "f1" in qa and "em" in qa:
            lines.append(f"- {what}: held-out F1 {qa['f1']['a']:.3f} -> {qa['f1']['b']:.3f}, EM {qa['em']['a']:.3f} "
                         f"-> {qa['em']['b']:.3f} on {n} questions ([{name}/summary.md]({prefix}{name}/summary.md))")
        guard = ROOT / "docs" / name / "guard_results.json"
        if guard.exists():  # the no-harm check beside the gain (`longdoc eval guard`)
            line = json.loads(guard.read_text())["line"].replace("guard: ", "", 1)
            lines.append(f"  - no-harm check on real legal text never trained on: {line} "
                         f"([{name}/guard.md]({prefix}{name}/guard.md))")
    return "\n".join(lines)


def models_summary() -> str:
    """One line per tested family list (the README's summary of the supported-models page)."""
    zoo = _dict_entries(ROOT / "longdoc" / "models" / "zoo.py", ("PLAIN",))
    lines = [f"- plain causal LMs: {', '.join(k for k, _ in zoo.get('PLAIN', []))}"]
    for path, rows, _ in _family_lists():
        title = LISTS.get(path.name, f"tests/support/{path.name}").split(":")[0]
        title = title[:1].lower() + title[1:]
        lines.append(f"- {title} ({len(rows)}): {', '.join(k for k, _ in rows)}")
    for path in sorted((ROOT / "docs" / "models").glob("*.json")):
        rec = json.loads(path.read_text())
        counts = ", ".join(f"{v} {k}" for k, v in sorted(rec.get("counts", {}).items()))
        when = f" ({rec['date']})" if rec.get("date") else ""
        lines.append(f"- survey of every causal-LM type of transformers {rec.get('transformers', '?')} at "
                     f"cp={rec.get('cp', '?')}{when}: {counts}")
    return "\n".join(lines)


# The GPU recipes the training guide plans: (recipe files of one shape, GPUs, GPU kind); the rest comes from the recipe.
RECIPE_PLANS = ((("legal-32k.yaml", "medical-32k.yaml"), 8, "h100"), (("legal-128k.yaml",), 16, "h100"))


def recipe_plans() -> str:
    """The planner's peak and step time for the GPU recipes' shapes (read from the recipes), computed now by the code
    in this checkout."""
    from longdoc.plan.planner import PlanRequest, plan
    from longdoc.train.config import load_recipe

    lines = ["| recipe | `longdoc plan` command | peak per GPU | planner step | recipe compute |",
             "|---|---|---:|---:|---:|"]
    for files, gpus, gpu in RECIPE_PLANS:
        r = load_recipe(ROOT / "recipes" / files[0], [])
        t, par = r.train, r.parallelism
        model = r.model.name.split("/")[-1].removesuffix("-Instruct")
        accumulate = t.batch_size // (t.micro_batch_size * (gpus // par.cp_size))
        options = (f"--model {model} --seq-len {r.data.seq_len // 1024}k --gpus {gpus} --gpu {gpu} --cp {par.cp_size}"
                   f"{' --checkpointing' if t.activation_checkpointing else ''}"
                   f"{f' --loss-chunk {t.loss_chunk_tokens}' if t.loss_chunk_tokens else ''} "
                   f"--strategy {par.strategy} --{'' if par.fsdp else 'no-'}fsdp "
                   f"--{'' if par.offload_checkpoints else 'no-'}offload --{'' if par.tiled_mlp else 'no-'}tiled-mlp")
        best = plan(PlanRequest(model=model, seq_len=r.data.seq_len, gpus=gpus, gpu=gpu, cp=par.cp_size,
                                checkpointing=bool(t.activation_checkpointing), loss_chunk=t.loss_chunk_tokens,
                                strategy=par.strategy, offload=par.offload_checkpoints, tiled_mlp=par.tiled_mlp,
                                fsdp=par.fsdp)).best
        names = ", ".join(f"`{f}`" for f in files) + (" (same model and shape)" if len(files) > 1 else "")
        if best is None:
            lines.append(f"| {names} | `{options}` | does not fit | - | - |")
            continue
        rec = best.to_dict()
        minutes = t.steps * accumulate * rec["step_s"] / 60
        lines.append(f"| {names} | `{options}` | {rec['peak_gib']:.2f} GiB of {best.capacity_gib:.0f} | "
                     f"{rec['step_s']:.2f} s | {t.steps} x {accumulate} x {rec['step_s']:.2f} s = ~{minutes:.1f} min |")
    return "\n".join(lines)


# The issue-28 anchors: (label, PlanRequest keywords, the `longdoc plan` options that ask for it)
LONG_PLANS = (
    ("Llama-3.1-8B, full fine-tuning, 1M tokens, 8 x H100",
     dict(model="Llama-3.1-8B", seq_len=1 << 20, gpus=8, gpu="h100"), "--model Llama-3.1-8B --seq-len 1M --gpus 8"),
    ("Llama-3.1-8B, LoRA, 400k tokens, 1 x H100",
     dict(model="Llama-3.1-8B", seq_len=400 * 1024, gpus=1, gpu="h100", lora=True),
     "--model Llama-3.1-8B --seq-len 400k --gpus 1 --lora"),
    *((f"SmolLM2-135M, full fine-tuning, bf16 autocast, {n // 1024}k tokens, cp={cp} CPU ranks under 4 GiB",
       dict(model="SmolLM2-135M", seq_len=n, gpus=cp, cp=cp, gpu="cpu", memory_gib=4, precision="bf16",
            checkpointing=True),
       f"--model SmolLM2-135M --seq-len {n // 1024}k --gpus {cp} --cp {cp} --gpu cpu --memory-gib 4 --precision bf16 "
       f"--checkpointing") for cp, n in ((2, 54 * 1024), (4, 125 * 1024))),
)


def _upto(n: int, ceiling: int) -> str:
    """A longest-fitting length, or "at least" it where the search's ceiling itself fits."""
    return f"at least {n:,}" if n == ceiling else f"{n:,}"


def long_plans() -> str:
    """The planner with and without the memory features (offload, tiled MLP) on the longest-document anchors,
    computed now by the code in this checkout: formulas until a device measures them."""
    import dataclasses

    from longdoc.plan.planner import PlanRequest, longest_fitting, plan

    lines = ["| run | `longdoc plan` options | without offload / tiled MLP (/ FSDP on CPU) | recommended with them | "
             "longest that fits (without -> with) |", "|---|---|---|---|---:|"]
    for label, kw, options in LONG_PLANS:
        req = PlanRequest(**kw)
        off = dataclasses.replace(req, offload=False, tiled_mlp=False, fsdp=None if req.dev.is_gpu else False)
        without, best = plan(off), plan(req).best
        before = (f"{without.best.memory.total_gib:.1f} GiB" if without.best else
                  f"does not fit ({without.closest.memory.total_gib:.1f} GiB)")
        after = f"{best.describe()}: {best.memory.total_gib:.1f} GiB" if best else "does not fit"
        far = dataclasses.replace(req, seq_len=1 << 24)

        longest = " -> ".join(_upto(longest_fitting(r), far.seq_len)
                              for r in (dataclasses.replace(off, seq_len=far.seq_len), far))
        lines.append(f"| {label} | `{options}` | {before} | {after} | {longest} |")
    return "\n".join(lines)


def changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


def module_map() -> str:
    """docs/development.md's module map (docs/hooks/modulemap.py, loaded by path: mkdocs and the tests load this file
    by path too, and docs/hooks is no package)."""
    spec = importlib.util.spec_from_file_location("modulemap", Path(__file__).with_name("modulemap.py"))
    modulemap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modulemap)
    return modulemap.module_map()


BLOCKS: dict[str, Callable[[], str]] = {"models": models, "performance": performance, "headline": headline,
                                        "changelog": changelog, "outcomes": outcomes, "models-summary": models_summary,
                                        "recipe-plans": recipe_plans, "long-plans": long_plans,
                                        "longest-matrix": longest_matrix, "module-map": module_map}
# The committed files with generated blocks, each with the blocks whose links depend on where the file sits.
FILES: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"headline": lambda: headline("docs/performance.md"), "outcomes": lambda: outcomes("docs/")},
    "docs/development.md": {},
}


def render_markers(markdown: str) -> str:
    return MARKER.sub(lambda m: BLOCKS[m.group(1)]() if m.group(1) in BLOCKS else m.group(0), markdown)


def refresh(text: str, blocks: dict[str, Callable[[], str]] | None = None) -> str:
    """`text` with every generated block (between its start and end lines) written afresh."""
    blocks = {**BLOCKS, **(blocks or {})}
    return FILE_BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)]() + "\n" + m.group(4), text)


def stale() -> list[str]:
    """The FILES whose generated blocks differ from what the checkout generates now."""
    return [name for name, blocks in FILES.items()
            if refresh(text := (ROOT / name).read_text(), blocks) != text]


# mkdocs hook: fill the markers of every page; a committed block is rendered afresh, without its start/end lines.
def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return render_markers(FILE_BLOCK.sub(lambda m: BLOCKS[m.group(2)](), markdown))


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "models"
    if what == "refresh":
        for name, blocks in FILES.items():
            path = ROOT / name
            path.write_text(refresh(path.read_text(), blocks))
        return 0
    if what == "check":
        names = stale()
        for name in names:
            print(f"{name}'s generated blocks are stale: run `python docs/hooks/docgen.py refresh`")
        return 1 if names else 0
    if what not in BLOCKS:
        print(f"docgen: unknown block {what!r}; choose from {', '.join([*BLOCKS, 'refresh', 'check'])}")
        return 2
    print(BLOCKS[what]())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
