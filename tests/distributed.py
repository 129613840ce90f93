"""Test-side name for the local gloo launcher (see longdoc.spawn)."""

from longdoc.spawn import run_local as run_ranks

__all__ = ["run_ranks"]
