"""The documentation: the site builds strictly and offline, its generated pages say what the files say, the README's
generated blocks are fresh, and the examples (fenced blocks marked runnable, examples/*.py) run on tiny models.

A block is runnable when the line before its fence is `<!-- runnable -->` (one process) or
`<!-- runnable: torchrun N -->` (N gloo ranks): such blocks are complete programs that check their own result.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable(?::\s*torchrun (\d+))? -->\n```python\n(.*?)^```", re.M | re.S)


def _docgen():
    spec = importlib.util.spec_from_file_location("docgen", ROOT / "docs" / "hooks" / "docgen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return env


def test_site_builds_strict_and_offline(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert time.perf_counter() - start < 240  # about 5 s on 2 cores; far more means something went wrong
    html = {p: p.read_text() for p in (tmp_path / "site").rglob("*.html")}
    # Offline: nothing the pages load comes from the network (Material's Google Fonts are off).
    asset = re.compile(r'(?:src|href)="(https?://[^"]+\.(?:css|js|woff2?))"')
    remote = {str(p): m for p, t in html.items() for m in asset.findall(t)}
    assert not remote and "fonts.googleapis" not in "".join(html.values()), remote
    # The API reference rendered the public objects (mkdocstrings fails the strict build on a missing one).
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("ContextParallel", "attention", "patch", "shard_batch", "KVSession", "CPTrainerMixin", "Packed"):
        assert 'id="longdoc.' in api and name in api, name
    # No generated marker is left unreplaced.
    assert not [p for p, t in html.items() if "docgen:" in t]


def test_models_page_lists_every_tested_family():
    import importlib

    docgen = _docgen()
    page = docgen.models()
    from longdoc.models import zoo

    for name in [*zoo.PLAIN, *zoo.PATTERNED]:
        assert f"`{name}`" in page or f"`tiny:{name}`" in page, name
    listed = docgen._family_lists()
    # every list a distributed test imports is on the page (hf_families, hf_dsa, hf_hybrids, hf_hybrids_linear
    # so far; a list that lands later is found by the same pattern)
    assert {p.name for p, _, _ in listed} >= {"hf_families.py", "hf_dsa.py", "hf_hybrids.py",
                                              "hf_hybrids_linear.py"}
    for path, rows, _ in listed:
        # the ast reader agrees with the imported list (a dict built another way would be missed silently);
        # TESTED, where a module has it, is the families it runs (aliases added for the survey are left out)
        mod = importlib.import_module(f"tests.support.{path.stem}")
        imported = next(getattr(mod, n) for n in docgen.LIST_NAMES if getattr(mod, n, None))
        expected = set(getattr(mod, "TESTED", imported))
        assert expected <= {k for k, _ in rows}, (path.name, expected - {k for k, _ in rows})
        for key, _ in rows:
            assert f"`{key}`" in page, (path.name, key)
    summary = docgen.models_summary()
    for path, rows, _ in listed:
        assert f"({len(rows)}): " in summary, path.name


def test_performance_page_renders_every_bench_file():
    docgen = _docgen()
    page = docgen.performance()
    for path in (ROOT / "docs" / "bench").glob("*.json"):
        assert f"docs/bench/{path.name}" in page
    assert "no renderer" not in page
    for png in (ROOT / "docs" / "bench").glob("*.png"):
        assert f"bench/{png.name}" in page


def test_generated_blocks_are_fresh():
    # the README's numbers and docs/development.md's module map, as `make docs` checks them
    assert not _docgen().stale(), "run `python docs/hooks/docgen.py refresh`"


def test_module_map_lists_every_module():
    page = _docgen().module_map()
    listed = dict(re.findall(r"^- `([\w.]+)`: (.+)$", page, re.M))
    for path in (ROOT / "longdoc").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith(".__init__"):  # a package: its own heading, its docstring's sentence below it
            assert f"### `{name.removesuffix('.__init__')}`\n\n" in page, name
        else:
            assert listed.get(name, "").strip(), name


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for i, m in enumerate(RUNNABLE.finditer(page.read_text())):
            out.append((f"{page.relative_to(ROOT)}#{i}", int(m.group(1) or 1), m.group(2)))
    return out


BLOCKS = _blocks()


def test_there_are_runnable_blocks():
    assert len(BLOCKS) >= 2, BLOCKS  # the README: attention and patch


def _run(args: list[str], ranks: int, cwd: Path, timeout: int = 420) -> None:
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *args]
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.parametrize("where,ranks,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_runnable_block(where, ranks, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    _run([str(script)], ranks, tmp_path)


# sft_cp.py runs in the fast tier; the others' trainers are tested at cp=2 in tests/dist (test_hf_trainer, _dpo)
@pytest.mark.parametrize("example,extra", [pytest.param("trainer_cp.py", [], marks=pytest.mark.slow),
                                           ("sft_cp.py", ["--packing"]),
                                           pytest.param("dpo_cp.py", [], marks=pytest.mark.slow)])
def test_example_runs_on_a_tiny_model(example, extra, tmp_path):
    # 2 gloo ranks, one training step and the evaluation: ~22 s (trainer) and ~50 s (TRL, packed) on 2 cores.
    _run([str(ROOT / "examples" / example), "--model", "tiny:llama", "--tokens", "1024", "--steps", "1",
          "--output-dir", str(tmp_path / "out"), *extra], 2, tmp_path)
