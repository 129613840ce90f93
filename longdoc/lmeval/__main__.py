"""`python -m longdoc.lmeval [lm-eval arguments]`: lm-eval's command line with the longdoc model registered.

Under torchrun / accelerate launch every process is one CP rank serving the same requests; all of them run
the evaluation in lock-step and only global rank 0 prints and writes results (lm-eval alone would let the
local rank 0 of every node write)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    import longdoc.lmeval.model  # noqa: F401 - registers the "longdoc" model
    from longdoc.launch import launched_world

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if not launched_world().is_main:
        evaluate = lm_eval.simple_evaluate

        def on_rank_zero_only(*args, **kwargs):
            evaluate(*args, **kwargs)  # the same requests, in lock-step with rank 0
            return None  # lm-eval's command line prints and writes nothing for None

        lm_eval.simple_evaluate = on_rank_zero_only
    cli_evaluate()


if __name__ == "__main__":
    main()
