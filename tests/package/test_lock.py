"""The lock of tested versions: `make install` installs exactly constraints.txt, and the lock tool round-trips."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tools import lockfile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("LONGDOC_UNLOCKED") == "1", reason="make test-latest runs on the newest releases")
def test_the_install_is_the_locked_one():
    assert lockfile.drift(ROOT / "constraints.txt") == []


def test_the_lock_covers_what_the_package_needs_and_never_torch():
    pins = lockfile.read(ROOT / "constraints.txt")
    assert "torch" not in pins and "longdoc" not in pins
    text = (ROOT / "pyproject.toml").read_text()
    needed = re.findall(r'^\s*"([A-Za-z0-9_.-]+)[><=\[]', text.split("[project.optional-dependencies]")[0], re.M)
    for name in needed:
        if name != "torch":
            assert lockfile._key(name) in pins, name


def test_the_lock_is_written_and_read_back(tmp_path):
    have = {"transformers": "5.25.0", "accelerate": "1.16.0", "huggingface-hub": "2.4.0"}
    path = tmp_path / "constraints.txt"
    path.write_text(lockfile.render(have))
    assert lockfile.read(path) == have
    assert lockfile.drift(path, {**have, "transformers": "5.26.0"}) == ["transformers: locked 5.25.0, installed 5.26.0"]
    assert lockfile.drift(path, {"transformers": "5.25.0", "accelerate": "1.16.0"}) == [
        "huggingface-hub: locked 2.4.0, installed none"]


def test_the_makefile_installs_with_the_lock():
    make = (ROOT / "Makefile").read_text()
    assert "-c $(CONSTRAINTS) -e '.[dev]'" in make and "test-latest:" in make and "lock:" in make
