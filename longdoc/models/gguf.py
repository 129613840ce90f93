"""GGUF -> safetensors conversion into longdoc's cache, built once and atomically, even by ranks starting together.

    folder = convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # <cache>/models/<stem>-<key>/
    atomic_build(target, build)     # the folder-building step on its own (a lock + an atomic rename)

The cache root is `$LONGDOC_CACHE`, else `$XDG_CACHE_HOME/longdoc`, else `~/.cache/longdoc`. A
half-written folder is never picked up: it is built under a temporary name (`longdoc.io.building_dir`)
and renamed into place with a completion marker. A file lock makes one process convert while the
others wait; where locks do not work, the process that loses the rename race uses the winner's folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from longdoc.io import building_dir

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so stale cache folders are not reused.
_CONVERSION_VERSION = 1
_DONE_MARKER = "longdoc-conversion.json"
_STALE_TMP_S = 24 * 3600


def default_cache_dir() -> Path:
    """The cache root: $LONGDOC_CACHE, else $XDG_CACHE_HOME/longdoc, else ~/.cache/longdoc."""
    if os.environ.get("LONGDOC_CACHE"):
        return Path(os.environ["LONGDOC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "longdoc"



def convert_gguf(gguf_path: Path, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert a GGUF file once into a cached safetensors folder (model, config, tokenizer)."""
    gguf_path = Path(gguf_path).resolve()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    try:
        return atomic_build(target, lambda tmp: _convert_gguf_into(gguf_path, tmp))
    except PermissionError as err:
        raise PermissionError(
            f"cannot write the converted model under {root}: {err}. Set LONGDOC_CACHE (or pass cache_dir) "
            "to a writable folder"
        ) from err


def atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, building it first with `build(tmp_folder)` if it is not complete.

    The folder is built under a temporary name in the same parent and renamed into place, so it
    either exists complete or not at all. A process that loses the rename race uses the winner's.
    """
    target = Path(target)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if _is_complete(target):  # another process finished while we waited for the lock
            return target
        _remove_stale_tmps(target)
        built = False
        try:
            # building_dir renames the folder onto `target` when the block ends, and deletes it on any error
            with building_dir(target, replace=False) as tmp:
                build(tmp)
                (tmp / _DONE_MARKER).write_text(json.dumps({"version": _CONVERSION_VERSION, "time": time.time()}))
                _share_like_umask(tmp)
                built = True
        except OSError:
            if not built:
                raise
            # The rename onto a non-empty folder failed: someone else got there first (no lock on this
            # filesystem). Theirs is as good as ours if it is complete.
            if not _is_complete(target):
                raise RuntimeError(
                    f"{target} exists but is not a complete longdoc conversion; delete it and retry"
                ) from None
    return target


def _convert_gguf_into(gguf_path: Path, out: Path) -> None:
    from transformers import GgufConfig

    logger.info("converting %s once to safetensors in %s (about half a minute)", gguf_path, out.parent)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        template = read_gguf_field(gguf_path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    # dequantize=True unpacks every weight into plain fp32 tensors, even where a GGUF matmul kernel
    # is installed that would otherwise keep them packed (and unsaveable).
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    _clear_quantizer_markers(model)
    _tidy_gguf_config(model.config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _clear_quantizer_markers(model: PreTrainedModel) -> None:
    """Drop what the GGUF loader leaves behind so `save_pretrained` writes a plain model."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("transformers.integrations.gguf"):
            raise RuntimeError(f"GGUF weights of {name!r} stayed packed ({type(module).__name__}); cannot convert")
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise RuntimeError(f"GGUF tensor {name!r} was not dequantized (dtype {tensor.dtype}); cannot convert")
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if hasattr(model, attr):
            delattr(model, attr)
    model.is_quantized = False
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config


def _tidy_gguf_config(config: PretrainedConfig) -> None:
    import numpy as np

    # GGUF stores floats as fp32 (1e-5 comes back 9.999999747e-06); restore the short decimal.
    for key in ("rms_norm_eps", "layer_norm_eps"):
        value = getattr(config, key, None)
        if isinstance(value, float):
            setattr(config, key, float(str(np.float32(value))))
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2"): not a loadable name or path.
    if "_model_name_or_path" in vars(config):
        del config._model_name_or_path


def read_gguf_field(path: Path, key: str) -> Any:
    """One metadata field of a GGUF file (None when absent)."""
    from gguf import GGUFReader  # the `gguf` PyPI package, not this module

    field = GGUFReader(str(path)).fields.get(key)
    return None if field is None else field.contents()


def _file_key(path: Path) -> str:
    """A cheap content key: size, head and tail of the file, and the conversion version."""
    digest = hashlib.sha256(f"v{_CONVERSION_VERSION}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:12]


def _share_like_umask(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; a shared cache should follow the umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _is_complete(folder: Path) -> bool:
    return (folder / _DONE_MARKER).is_file()


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    # Only saves work (one rank converts, the others wait); correctness comes from the rename.
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # some network filesystems refuse locks
            pass
        yield


def _remove_stale_tmps(target: Path) -> None:
    # A crash mid-build leaves a temp folder that is never read; sweep old ones (a fresh one may
    # belong to a process on another machine sharing the cache).
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)

