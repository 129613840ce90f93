"""`python -m longdoc.lmeval [lm-eval arguments]`: lm-eval's command line with the longdoc model registered; with
`--model_args ...,cp=N` and no launcher it starts its N local CPU ranks itself (longdoc.lmeval.cli)."""

from __future__ import annotations

import sys

from longdoc.lmeval.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
