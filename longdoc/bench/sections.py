"""The sections of `longdoc bench`, in the order they run.

A module of its own (no imports) so that the command line lists them without importing torch.
"""

from __future__ import annotations

SECTIONS: tuple[str, ...] = ("attention", "hybrid", "train", "memory", "longest", "calibration", "dsa", "kinds",
                              "gpu")
