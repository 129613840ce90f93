"""The lock of tested versions (constraints.txt): write it from the installed distributions, check it against them.

    python tools/lockfile.py constraints.txt          # write: every installed distribution but torch and longdoc
    python tools/lockfile.py --check constraints.txt  # exit 1 with the differences when the install drifted

`make install` installs with `pip install -c constraints.txt`; `make test-latest` runs the suite on the newest
releases in .venv-latest and `make lock` (this script, run there) records them. torch is pinned by the Makefile's
TORCH_SPEC instead (a CPU or a CUDA build of one version), so it is never locked here.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

UNLOCKED = frozenset({"torch", "longdoc", "pip", "setuptools", "wheel"})


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """{normalised name: version} of every installed distribution that the lock covers."""
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _key(name) not in UNLOCKED:
            out[_key(name)] = dist.version
    return out


def read(path: str | Path) -> dict[str, str]:
    """{normalised name: version} of a constraints file's `name==version` lines."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins[_key(name)] = version.strip()
    return pins


def drift(path: str | Path, have: dict[str, str] | None = None) -> list[str]:
    """Locked distributions installed at another version (or missing), one line each."""
    have = installed() if have is None else have
    return [f"{name}: locked {want}, installed {have.get(name, 'none')}"
            for name, want in sorted(read(path).items()) if have.get(name) != want]


def render(have: dict[str, str]) -> str:
    torch_version = have.get("torch") or _torch_version()
    header = [
        f"# The versions the test suite last passed with ({datetime.date.today()}, Python {platform.python_version()}, "
        f"torch {torch_version}).",
        "# make install uses it as pip constraints (-c); pyproject.toml keeps the compatible ranges for users.",
        "# torch is not here: the Makefile's TORCH_SPEC pins it (CPU or CUDA build). To move to newer releases:",
        "# make test-latest (the suite on the newest releases, in .venv-latest), then make lock to write them here.",
    ]
    return "\n".join(header + [f"{name}=={version}" for name, version in sorted(have.items())]) + "\n"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/lockfile.py", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the constraints file (constraints.txt)")
    parser.add_argument("--check", action="store_true", help="compare the install with the file instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        lines = drift(args.path)
        print("\n".join(lines) if lines else f"the install matches {args.path}")
        return 1 if lines else 0
    tmp = Path(f"{args.path}.tmp")
    tmp.write_text(render(installed()))
    tmp.replace(args.path)
    print(f"wrote {args.path}: {len(read(args.path))} locked distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
