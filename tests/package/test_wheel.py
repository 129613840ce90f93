"""The package as a user installs it: `python -m build` makes an sdist and a wheel, and the wheel installed into a
fresh venv (torch from the pinned CPU wheel, nothing from this checkout) answers `longdoc --version` / `--help`,
imports the public API and finds its run-time files (synth templates, planner configs, recipes) without a checkout.

Two installs of the same wheel:
- default suite: a new venv that borrows the dependencies from the running one (a .pth line adds its site-packages:
  the .pth files there, among them the editable install of this checkout, are not processed), the wheel installed
  with --no-deps; a few seconds, and it still imports longdoc only from the wheel.
- slow: a fully fresh venv, `pip install torch==2.13.0` (the Makefile's pin, the CPU wheel on this machine) then
  the wheel with its dependencies from the registry, as a user does. 464 s on the 2-core machine shared with
  other jobs (load ~20; 108 s of CPU time), so it is marked slow.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import longdoc
from longdoc.runtime.resources import CHECKOUT_PATHS

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("LONGDOC_TEST_TORCH_SPEC", "torch==2.13.0")  # the Makefile's pin (CPU wheel here)

# What a user's first minute touches: the public API, the heavy integrations, and every resource kind.
SMOKE = """
import longdoc, longdoc.hf, longdoc.parallel.api
from longdoc import ContextParallel, attention, patch
from longdoc.hf import CPTrainer, CPTrainerMixin, KVSession, UnsupportedFeatureError, generate, shard_batch
from longdoc.runtime.resources import resource_dir
from longdoc.corpus.synth.text import load_data
from longdoc.plan.shapes import model_shape
assert patch is longdoc.hf.patch
site = longdoc.__file__.rsplit("/", 1)[0]
for name in ("synth", "configs", "recipes"):
    assert str(resource_dir(name)).startswith(site), (name, resource_dir(name), site)
assert load_data("legal", "questions") and load_data("common", "names")
assert model_shape("Llama-3.1-8B").params.total == 8_030_261_248
print("smoke ok", longdoc.__version__)
"""


def _run(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=ROOT)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def test_build_makes_an_sdist_and_a_wheel_that_carry_the_run_time_files(built):
    assert built["wheel"].name == f"longdoc-{longdoc.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(built["wheel"]) as z:
        names = set(z.namelist())
        for resource, checkout in CHECKOUT_PATHS.items():
            expected = _files(ROOT / checkout)
            assert expected, checkout
            for rel, content in expected.items():
                assert z.read(f"longdoc/_bundled/{resource}/{rel}") == content, (resource, rel)
        assert "longdoc/py.typed" in names
        metadata = z.read(f"longdoc-{longdoc.__version__}.dist-info/METADATA").decode()
    assert f"Version: {longdoc.__version__}" in metadata
    with tarfile.open(built["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", "longdoc/__init__.py", "data/synth/legal/vocab.json",
                   "recipes/cpu-demo.yaml", "tests/support/hf_families.py"):
        assert needed in members, needed


def _check_installed(env_dir: Path, work: Path) -> None:
    py, cli = env_dir / "bin" / "python", env_dir / "bin" / "longdoc"
    # work is outside the checkout, so nothing below can import or read the repository's files
    assert _run([str(cli), "--version"], cwd=work).stdout.strip() == f"longdoc {longdoc.__version__}"
    help_text = _run([str(cli), "--help"], cwd=work).stdout
    for verb in ("train", "eval", "data", "plan", "verify", "recipes"):
        assert verb in help_text, verb
    assert "smoke ok" in _run([str(py), "-c", SMOKE], cwd=work).stdout
    _run([str(cli), "recipes", "--copy", str(work)], cwd=work)
    assert _files(work / "recipes") == _files(ROOT / "recipes")


def test_the_wheel_runs_without_the_checkout(built, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    target = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=tmp_path).stdout.strip())
    borrowed = [p for p in {sysconfig.get_path("purelib"), *site.getsitepackages()} if Path(p).is_dir()]
    (target / "borrowed_deps.pth").write_text("\n".join(borrowed) + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(built["wheel"])], cwd=tmp_path)
    origin = _run([str(py), "-c", "import longdoc; print(longdoc.__file__)"], cwd=tmp_path).stdout.strip()
    assert origin.startswith(str(target)), f"longdoc imported from {origin}, not from the installed wheel"
    _check_installed(env_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_wheel_installs_into_a_fresh_venv_with_its_dependencies(built, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", *TORCH_SPEC.split()], cwd=tmp_path)  # first: see the Makefile
    _run([str(py), "-m", "pip", "install", "-q", str(built["wheel"])], cwd=tmp_path)
    _check_installed(env_dir, tmp_path)
