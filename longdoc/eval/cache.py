"""Evaluation results reused by content: a model that did not change is not evaluated twice.

`eval compare` and `eval guard` evaluate the base model beside every tuned model; the base's results depend only
on what went in. Each (model, task) is keyed by the SHA-256 of
  - the model's files (every file of its folder; the default model's converted folder; `tiny:` names by name),
  - every input file or folder the task's settings name (data, haystacks), by content,
  - the task's settings themselves (all of them but where to write and how many threads), the CP size included,
  - the longdoc, torch and transformers versions, and the source of the code that decides what an evaluation asks
    and how it scores (longdoc/eval and the document generator, longdoc/corpus/synth): a changed needle sentence
    or metric is a new key even before a version bump,
and its result is kept as JSON in the cache folder (default ~/.cache/longdoc/eval, or $XDG_CACHE_HOME/longdoc/eval;
`--cache-dir DIR`, `--no-cache`). A hub id that is not a local folder is never cached: its content is unknown here.
Only a process that decides for every rank uses the cache (the spawning parent, or one process alone): under a
launcher each rank would look at its own disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

# Settings that say where or how fast a run goes, never what it computes.
_VOLATILE = frozenset({"out", "threads", "timeout", "a", "b", "names", "model", "cache", "cache_dir", "progress",
                       "suite_models", "suite_tasks", "func", "verb", "eval_cmd"})
_digests: dict[tuple, str] = {}


def default_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longdoc" / "eval"


def _files_digest(path: Path) -> str:
    """SHA-256 over a file's or folder's files (relative names and contents); memoised by name, size and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stamp = (str(path.resolve()), tuple((str(p), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]))
    if stamp not in _digests:
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(path) if p != path else p.name).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        _digests[stamp] = h.hexdigest()
    return _digests[stamp]


def model_digest(model: str) -> str | None:
    """The model's content digest, None when it is not on this disk (a hub id)."""
    from longdoc.models import resolve
    from longdoc.models.tiny import TINY_PREFIX

    if model.startswith(TINY_PREFIX):
        return "tiny:" + hashlib.sha256(model.encode()).hexdigest()
    folder = Path(resolve(model))
    return _files_digest(folder) if folder.is_dir() else None


def _inputs(value: Any) -> list[str]:
    """Digests of every existing file or folder named among the settings' values."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_files_digest(Path(v)) for v in values if isinstance(v, str) and v and os.path.exists(v)]


def source_digest() -> str:
    """SHA-256 over the evaluation code's source files (longdoc/eval, longdoc/corpus/synth), memoised."""
    if ("source",) not in _digests:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for p in sorted([*(root / "eval").rglob("*.py"), *(root / "corpus" / "synth").rglob("*.py")]):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
        _digests[("source",)] = h.hexdigest()
    return _digests[("source",)]


def key(model: str, cfg: dict[str, Any]) -> str | None:
    """The cache key of `cfg` (one task's settings) on `model`, None when the model's content is unknown."""
    import torch
    import transformers

    import longdoc

    digest = model_digest(model)
    if digest is None:
        return None
    settings = {k: v for k, v in sorted(cfg.items()) if k not in _VOLATILE}
    inputs = {k: digests for k, digests in ((k, _inputs(v)) for k, v in settings.items()) if digests}
    blob = json.dumps({"model": digest, "settings": settings, "inputs": inputs,
                       "versions": [longdoc.__version__, torch.__version__, transformers.__version__],
                       "source": source_digest()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def load(folder: Path, k: str | None) -> dict[str, Any] | None:
    if k is None or not (folder / f"{k}.json").is_file():
        return None
    try:
        return json.loads((folder / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None  # a damaged entry is evaluated again (and rewritten)


def store(folder: Path, k: str | None, result: dict[str, Any]) -> None:
    from longdoc.eval import report

    if k is not None:
        report.write_json(folder / f"{k}.json", result)
