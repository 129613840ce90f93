"""`python -m longdoc.lmeval [lm-eval arguments]`: lm-eval's command line with the longdoc model registered.

Under torchrun / accelerate launch every process is one CP rank serving the same requests; all of them run
the evaluation in lock-step and only global rank 0 prints and writes results (lm-eval alone would let the
local rank 0 of every node write). Without a launcher, `--model longdoc --model_args ...,cp=N` starts its N
ranks itself on a machine without CUDA (local gloo processes, as `longdoc eval --cp N` does); with CUDA it names
the torchrun command to run. Bad input (a model that does not resolve, a max_length past the model's context, an
error a rank raises alike on every rank) is one line on stderr and exit status 2, checked in the parent where it
can be, before any rank starts.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

PROG = "python -m longdoc.lmeval"


def _evaluate(argv: list[str]) -> None:
    """lm-eval's own command line on `argv`, in this process (one rank of the launched world, or the only one)."""
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    import longdoc.lmeval.model  # noqa: F401 - registers the "longdoc" model
    from longdoc.runtime.launch import launched_world

    sys.argv = [sys.argv[0], *argv]
    if not launched_world().is_main:
        evaluate = lm_eval.simple_evaluate

        def on_rank_zero_only(*args, **kwargs):
            evaluate(*args, **kwargs)  # the same requests, in lock-step with rank 0
            return None  # lm-eval's command line prints and writes nothing for None

        lm_eval.simple_evaluate = on_rank_zero_only
    try:
        cli_evaluate()
    except SystemExit as e:  # `--help` and lm-eval's own usage errors end the process their way
        if e.code not in (None, 0):
            raise


def model_args(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """(--model, --model_args as a dict) as lm-eval will see them: its own parser, then its --config YAML for what
    the command line leaves out. An argument error exits 2 with lm-eval's usage, as lm-eval itself would."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import simple_parse_args_string

    saved = sys.argv
    sys.argv = [PROG, *argv]  # HarnessCLI reads (and edits) sys.argv
    try:
        args = HarnessCLI().parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "command", None) != "run":
        return None, {}
    model, margs = getattr(args, "model", None), getattr(args, "model_args", None)
    if getattr(args, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        yaml = EvaluatorConfig.load_yaml_config(args.config)
        model, margs = model or yaml.get("model"), margs or yaml.get("model_args")
    if isinstance(margs, str):
        margs = simple_parse_args_string(margs)
    return model, dict(margs or {})


def check(margs: dict[str, Any]) -> None:
    """The longdoc model's arguments that can be checked without loading weights: the model resolves, and
    max_length fits its context (as LongDocLM checks after loading)."""
    from longdoc.train.config import ModelConfig
    from longdoc.train.modeling import check_context
    from longdoc.train.preflight import model_context

    mcfg = ModelConfig(name=str(margs.get("pretrained", "SmolLM2-135M-Instruct")), rope_type=margs.get("rope_type"),
                       rope_factor=float(margs.get("rope_factor") or 1.0))
    limit = model_context(mcfg)
    if margs.get("max_length") is not None:
        n = int(margs["max_length"])
        check_context(n, limit, what=f"max_length={n}", extend="rope_type=yarn,rope_factor={factor}",
                      shorten="lower max_length")


def _rank(rank: int, world_size: int, argv: list[str]) -> None:
    import torch

    from longdoc.runtime.launch import set_launcher_env

    # lm-eval and Accelerate read the launcher's variables; the group is joined already (longdoc.runtime.spawn)
    set_launcher_env(rank, world_size, OMP_NUM_THREADS=str(torch.get_num_threads()))
    _evaluate(argv)


def _spawn(argv: list[str], cp: int, margs: dict[str, Any]) -> None:
    import torch

    from longdoc.errors import USER_ERRORS
    from longdoc.runtime.spawn import run_local

    if torch.cuda.is_available():
        raise ValueError(f"cp={cp} needs {cp} processes, one per CP rank; on GPUs start them with `torchrun "
                         f"--nproc_per_node {cp} -m longdoc.lmeval ...` (or `accelerate launch --multi_gpu "
                         f"--num_processes {cp} -m longdoc.lmeval ...`)")
    threads = max(1, (os.cpu_count() or 1) // cp)
    print(f"{PROG}: no launcher: starting {cp} local CPU processes (cp={cp}, {threads} thread(s) each); for GPUs or "
          f"several machines use torchrun or accelerate launch", flush=True)
    run_local(cp, _rank, argv, threads=threads, deadline=30 * 86400, pg_timeout=float(margs.get("timeout", 1800)),
              input_errors=USER_ERRORS)


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's command line on `argv` (default: this process's arguments); returns the exit status."""
    from longdoc.errors import EXIT_BUG, EXIT_USAGE, USER_ERRORS
    from longdoc.runtime.launch import launched_world

    argv = list(sys.argv[1:] if argv is None else argv)
    if launched_world().launched:  # one rank of a launched world: every process runs the evaluation
        _evaluate(argv)
        return 0
    try:
        model, margs = model_args(argv)
        if model == "longdoc":
            check(margs)
            cp = int(margs.get("cp", 1))
            if cp > 1:
                _spawn(argv, cp, margs)
                return 0
        _evaluate(argv)
        return 0
    except USER_ERRORS as e:
        from longdoc.cli import one_line

        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - not the user's input: show where it broke, with its own exit status
        traceback.print_exc()
        print(f"{PROG}: internal error (a bug, not bad input); please report the traceback above", file=sys.stderr)
        return EXIT_BUG
