"""`longdoc train RECIPE.yaml [key=value ...]`.

    longdoc train recipes/cpu-demo.yaml parallelism.cp_size=1 train.steps=4   # one process
    longdoc train recipes/cpu-demo.yaml                                  # cp_size 2: starts 2 local CPU ranks
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml
    longdoc train recipes/cpu-demo.yaml --print                          # the effective recipe, then exit
    longdoc train recipes/cpu-demo.yaml --nproc 2 train.steps=8 resume=auto   # continue if there is a checkpoint

Options may come anywhere among the overrides. resume=true continues from the newest checkpoint in output_dir
and refuses one without any; resume=auto starts at step 0 there instead. The recipe, output_dir against resume,
the model name and context and the data paths are checked here, before any rank starts (longdoc.train.preflight).

Without a launcher on a machine without CUDA, a recipe with parallelism.cp_size > 1 starts its ranks itself
(longdoc.runtime.spawn: local gloo processes, as `longdoc verify` and `eval --cp N` do); `--nproc N` starts N (dp = N /
cp_size). Under `accelerate launch` / `torchrun` every process is one rank. With CUDA and no launcher the error
names the accelerate command to run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def add_parser(subparsers) -> None:
    from longdoc.errors import EXIT_CODES

    p = subparsers.add_parser(
        "train", help="fine-tune a causal LM on long documents with context parallelism",
        description="Train from a YAML recipe; key=value arguments override recipe keys (dotted: train.steps=5). "
                    "On CPU without a launcher, parallelism.cp_size > 1 starts the local ranks itself; under "
                    "`accelerate launch` (recipes/accelerate/*.yaml) every process is one rank.",
        epilog=EXIT_CODES + ".",
    )
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides, e.g. parallelism.cp_size=2 data.seq_len=8k (token counts: 8k = 8192) "
                        "resume=true (continue the run in output_dir; refused when it has no checkpoint) or "
                        "resume=auto (continue if it has one, else start at step 0); options may come anywhere "
                        "among them")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the effective recipe and exit")
    p.add_argument("--nproc", type=int, default=None,
                   help="local CPU processes to start when no launcher did (default: parallelism.cp_size; a "
                        "multiple of it)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from longdoc.train.config import RecipeError, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # RecipeError: one line, exit 2 (longdoc.cli)
    if args.print_only:
        import yaml

        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    from longdoc.runtime.launch import launched_world
    from longdoc.train.preflight import check_recipe

    check_recipe(recipe)  # model, context, data paths, resume: before any rank starts or any weights load
    cp = recipe.parallelism.cp_size
    nproc = args.nproc if args.nproc is not None else cp
    if launched_world().launched or nproc == 1:
        if args.nproc not in (None, 1) and launched_world().launched:
            raise RecipeError(f"--nproc {args.nproc} starts local ranks, but this process was started by a launcher "
                              f"already; drop --nproc (the launcher's --num_processes decides)")
        return _report(_train_here(recipe))
    import torch

    if nproc < 1 or nproc % cp:
        raise RecipeError(f"--nproc {nproc} must be a positive multiple of parallelism.cp_size={cp}")
    if torch.cuda.is_available():
        raise RecipeError(f"parallelism.cp_size={cp} needs {nproc} processes; on GPUs start them with `accelerate "
                          f"launch --num_processes {nproc} -m longdoc train {_command_args(args)}` (see "
                          f"recipes/accelerate/*.yaml for multi-GPU and multi-node configs)")
    return _report(_spawn(recipe, nproc))


def _command_args(args: argparse.Namespace) -> str:
    return shlex.join([args.recipe, *args.overrides])


def _train_here(recipe) -> tuple[str, str]:
    """("ok", summary) or ("stopped", why) for this process's part of the run."""
    from longdoc.train.loop import train

    try:
        result = train(recipe)
    except FloatingPointError as e:  # train.on_nonfinite=abort, or too many skipped steps
        return "stopped", str(e)
    from longdoc.train.report import summary

    return "ok", summary(result) if result.is_main else ""


def _rank(rank: int, world_size: int, recipe) -> tuple[str, str]:
    import torch

    from longdoc.runtime.launch import set_launcher_env

    # Accelerate reads the launcher's variables (the group is joined already), and warns unless OMP_NUM_THREADS is set
    set_launcher_env(rank, world_size, OMP_NUM_THREADS=str(torch.get_num_threads()))
    return _train_here(recipe)


def _spawn(recipe, nproc: int) -> tuple[str, str]:
    from longdoc.errors import USER_ERRORS
    from longdoc.runtime.spawn import run_local

    threads = max(1, (os.cpu_count() or 1) // nproc)
    print(f"longdoc train: no launcher: starting {nproc} local CPU processes (cp_size={recipe.parallelism.cp_size}, "
          f"{threads} thread(s) each); for GPUs or several machines use `accelerate launch`", flush=True)
    results = run_local(nproc, _rank, recipe, threads=threads, deadline=30 * 86400,
                        pg_timeout=float(recipe.train.comm_timeout), input_errors=USER_ERRORS)
    stopped = [r for r in results if r[0] == "stopped"]
    return stopped[0] if stopped else results[0]


def _report(outcome: tuple[str, str]) -> int:
    status, text = outcome
    if status == "stopped":
        print(f"longdoc train: stopped: {text}", file=sys.stderr)
        return 1
    if text:
        print(text, flush=True)
    return 0
