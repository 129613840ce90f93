"""Test-side name for the local gloo launcher (see longdoc.runtime.spawn)."""

from longdoc.runtime.spawn import run_local as run_ranks

__all__ = ["run_ranks"]
