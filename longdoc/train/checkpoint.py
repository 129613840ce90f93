"""Atomic, resumable checkpoints: torch.distributed.checkpoint for model + optimizer, JSON and
safetensors for the rest (no pickle of ours anywhere).

    OUTPUT/checkpoints/step-00000040/
        state/            DCP shards of model (trainable params) and optimizer; reshards on load
        rng-rank00000.*   this rank's RNG streams (safetensors + json)
        trainer.json      step, scheduler, data fingerprint, layout, recipe: written last

A checkpoint is written under `.step-XXXXXXXX.tmp` and renamed into place only when every rank has
finished its part, so a folder named `step-*` is complete by construction; a crash mid-write leaves a
dot-folder that is never read and is swept at the next start. Deletion of old checkpoints renames
first, for the same reason. The checkpoint folder must be shared by all ranks (one filesystem).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longdoc.errors import UserError
from longdoc.io import fsync_dir, remove_dir

_NAME = re.compile(r"^step-(\d{8})$")
STATE_FILE = "trainer.json"
FORMAT_VERSION = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what to do."""


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns on every save/load without a process group; one process is a supported case here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def starting_point(root: Path, resume: bool | str, overwrite: bool = False) -> Path | None:
    """The checkpoint a run continues from, or None to start at step 0; refused, before anything starts, where the
    folder and `resume` disagree. resume=true needs a checkpoint (as transformers' Trainer does: a typo in
    output_dir must not restart a long run from step 0); resume="auto" takes one if there is one; resume=false
    (without overwrite) refuses a folder holding another run's checkpoints."""
    found = latest(root)
    if resume is True and found is None:
        raise CheckpointError(f"resume=true but output_dir {root.parent} holds no complete checkpoint to continue "
                              f"from (no {root.name}/step-*; is it the run's folder?); pass resume=auto to continue "
                              f"when there is one and start at step 0 when there is none")
    if not resume and not overwrite and found is not None:
        raise CheckpointError(f"output_dir {root.parent} already holds checkpoints of a run; continue it with "
                              f"resume=true, start over with overwrite=true, or choose a fresh output_dir")
    return found if resume else None


def sweep(root: Path) -> None:
    """Remove leftovers of interrupted writes/deletes (rank 0, at start, before anyone writes)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") and (p.name.endswith(".tmp") or p.name.endswith(".deleting")):
                shutil.rmtree(p, ignore_errors=True)


def remove_all(root: Path) -> None:
    """Delete every checkpoint under root (overwrite=true), newest first so none is left half-deleted."""
    for _, folder in reversed(complete_checkpoints(root)):
        remove_dir(folder)
    sweep(root)


# ---- RNG state, per rank, without pickle ----

def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    version, state, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(state), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in meta and "numpy_keys" in tensors:
        import numpy as np

        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, tensors["numpy_keys"].numpy().astype("uint32"), pos, has_gauss, cached))


def _model_optim_state(model, optimizer, frozen_too: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # strict=False only where frozen parameters are left out on purpose; load() then checks that what
    # was not restored is exactly those parameters (and that their bytes match the ones trained on).
    opts = StateDictOptions(ignore_frozen_params=not frozen_too, strict=frozen_too)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd}, opts


def _frozen(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if not p.requires_grad]


def frozen_digest(model) -> dict[str, Any]:
    """Count and sha256 of the frozen parameters (names, dtypes, shapes, bytes): a checkpoint that leaves
    them out (LoRA) is only right on top of the very same base weights."""
    h = hashlib.sha256()
    frozen = _frozen(model)
    for name, p in frozen:
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"count": len(frozen), "sha256": h.hexdigest()}


def save(root: Path, step: int, model, optimizer, trainer_state: dict, keep: int,
         frozen_too: bool = False) -> Path:
    """Write checkpoint `step` atomically (all ranks call this); keep the newest `keep`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state, _ = _model_optim_state(model, optimizer, frozen_too)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp / "state"))
    tensors, meta = _rng_state()
    rank = _rank()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"rng-rank{rank:05d}.safetensors"))
    (tmp / f"rng-rank{rank:05d}.json").write_text(json.dumps(meta))
    _barrier()
    if rank == 0:
        extra = {} if frozen_too else {"frozen": frozen_digest(model)}  # every rank holds the same base
        body = json.dumps({"format": FORMAT_VERSION, **trainer_state, **extra}, indent=1, default=_json_default)
        with open(tmp / STATE_FILE, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. `every` hits the last step): replace
            remove_dir(final)
        os.rename(tmp, final)
        fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep]:
            remove_dir(old)
    _barrier()
    return final


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot store {type(o).__name__} in {STATE_FILE}")


def read_state(folder: Path) -> dict:
    path = folder / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({e}); delete {folder} to resume from "
                              f"the previous checkpoint") from e
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format {state.get('format')}, this longdoc reads {FORMAT_VERSION}")
    return state


def load(folder: Path, model, optimizer, frozen_too: bool = False) -> dict:
    """Restore model, optimizer and this rank's RNG from `folder` (all ranks); return trainer state."""
    import torch.distributed.checkpoint as dcp
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = read_state(folder)
    sd, opts = _model_optim_state(model, optimizer, frozen_too)
    try:
        with _single_process_quiet():
            dcp.load(sd, checkpoint_id=str(folder / "state"))
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        raise CheckpointError(f"checkpoint {folder / 'state'} could not be loaded: {_short(e)}. If a file there "
                              f"is truncated or corrupted, delete {folder} to resume from the previous "
                              f"checkpoint") from None
    if not frozen_too:
        _check_frozen(folder, state, model, sd["model"])
    result = set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                            options=opts)
    if not frozen_too and (result.unexpected_keys or len(result.missing_keys) != len(_frozen(model))):
        raise CheckpointError(f"checkpoint {folder} does not match this model: not restored "
                              f"{list(result.missing_keys)[:5]}, unexpected {list(result.unexpected_keys)[:5]} "
                              f"(same model and lora settings as the run that wrote it?)")
    rank = _rank()
    rng_t, rng_j = folder / f"rng-rank{rank:05d}.safetensors", folder / f"rng-rank{rank:05d}.json"
    if rng_t.is_file() and rng_j.is_file():
        try:
            _set_rng_state(load_file(str(rng_t)), json.loads(rng_j.read_text()))
        except (OSError, SafetensorError, json.JSONDecodeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint RNG file {rng_t} or {rng_j} is unreadable ({e}); delete "
                                  f"{folder} to resume from the previous checkpoint") from e
    else:
        state["rng_restored"] = False  # more ranks than when saved: they keep their fresh seeds
    return state


def _check_frozen(folder: Path, state: dict, model, trainable: dict) -> None:
    want = state.get("frozen")
    if want is None:
        return  # written before digests existed
    have = frozen_digest(model)
    if have != want:
        raise CheckpointError(
            f"cannot resume from {folder}: it holds only the trained parameters ({len(trainable)} tensors), and "
            f"this model's frozen parameters differ from those it was trained on ({have['count']} vs "
            f"{want['count']} tensors, sha256 {have['sha256'][:12]} vs {want['sha256'][:12]}); resume with the same "
            f"model.name, model.dtype, model.rope_* and lora.* as the run that wrote it, or start a new output_dir")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:500] if text else type(e).__name__
