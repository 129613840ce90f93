"""`longdoc ARGS` two ways for the command-line tests: `fresh`, as a user runs it (`python -m longdoc` in a new
process, about 4 s of importing torch and transformers each), and `here`, the same entry called in the test's own
process (imports paid once).

`here` gives the call what `fresh` gives a new process (hub offline, no progress bars, the working directory),
captures both file descriptors (so a library writing to fd 2 counts as much as a print), and undoes what the run
leaves behind: environment variables, Accelerate's process-wide state. Two things only a fresh process shows, so
a test claiming them keeps one `fresh` case: warnings (pytest records them instead of printing them) and the output
of spawned CP ranks (they fork from longdoc.runtime.spawn's fork server and write to its stderr, not the test's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def fresh(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m longdoc ARGS` in a new process, with this tree first on its path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **ENV, **env}
    return subprocess.run([sys.executable, "-m", "longdoc", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env=env)


def here(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture,
         **env: str) -> subprocess.CompletedProcess:
    """`longdoc ARGS` in this process as the console script runs it (longdoc.cli.main: bad input -> one line and
    exit 2, a bug -> its traceback and exit 3; argparse's own refusals exit through SystemExit), returned like
    `fresh`'s result."""
    import huggingface_hub
    from accelerate.state import AcceleratorState, GradientState
    from transformers.utils import logging as hf_logging

    from longdoc.cli import main

    monkeypatch.chdir(cwd)
    for name, value in {**ENV, **env}.items():
        monkeypatch.setenv(name, value)
    # both are read when huggingface_hub / transformers are imported, which happened before this call
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_bars, hf_bars = not huggingface_hub.utils.are_progress_bars_disabled(), hf_logging.is_progress_bar_enabled()
    huggingface_hub.utils.disable_progress_bars()
    hf_logging.disable_progress_bar()
    environ = dict(os.environ)
    capfd.readouterr()  # this call's output only
    try:
        code = main(list(args), catch=True)
    except SystemExit as e:
        code = e.code
    finally:
        out, err = capfd.readouterr()
        for name in set(os.environ) - set(environ):  # what the run set (a fresh process would just exit)
            del os.environ[name]
        os.environ.update(environ)
        AcceleratorState._reset_state()  # `train` at cp_size=1 builds an Accelerator in this process
        GradientState._reset_state()
        if hub_bars:
            huggingface_hub.utils.enable_progress_bars()
        if hf_bars:
            hf_logging.enable_progress_bar()
    return subprocess.CompletedProcess(["longdoc", *args], code, out, err)
