"""Strategy "usp": Ulysses inside groups of ulysses_size consecutive ranks, the ring across the groups (unified
sequence parallelism). Its configuration is the group's factoring: ContextParallel(group, ulysses_size=U), the
recipes' ulysses_size, the planner's --ulysses-size (longdoc/parallel/ulysses.py explains the trade-offs)."""

from __future__ import annotations

from longdoc.parallel.strategies.ulysses import Ulysses
from longdoc.parallel.strategy import register


class Usp(Ulysses):
    name = "usp"
    order = 3
    factored = True

    def heads_split(self, cp_size, ulysses_size):
        if ulysses_size is None or cp_size % ulysses_size:
            divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
            raise ValueError(f"strategy='usp' factors the CP group as ring_size x ulysses_size, so usp needs "
                             f"ulysses_size, a divisor of cp_size {cp_size}, got {ulysses_size!r}; create it with "
                             f"ContextParallel(group, ulysses_size=U), U one of {divisors} (recipes: "
                             f"parallelism.ulysses_size), or use strategy='ulysses' (U = the whole group) or 'ring'")
        return ulysses_size

    def factorings(self, cp, q_heads, pinned):
        # every proper factor 1 < U < cp (U = 1 is the ring, U = cp plain Ulysses), or the one asked for
        us = [pinned] if pinned else [u for u in range(2, cp) if cp % u == 0]
        return [u for u in us if u <= q_heads and cp % u == 0]

    def label(self, cp, ulysses):
        return f"usp {ulysses}x{cp // ulysses}"

    def describe(self, cp, ulysses):
        return f"usp (Ulysses {ulysses} x ring {cp // ulysses})"


register(Usp())
