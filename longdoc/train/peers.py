"""Lost-peer detection across nodes: when a node dies, the ranks of the others stop within seconds, naming it.

Why: when a whole node dies (SIGKILL, power, network), the survivors sit in a gloo collective until its
timeout (`train.comm_timeout`, minutes on long CPU steps), and then fail with "Timed out waiting ... for recv",
which names no rank. Inside one node the launcher (torchrun's agent) already stops every rank when one dies;
across nodes nothing does. So each rank of a multi-node launch starts a small watcher process
(`python -m longdoc.train.peers`) that beats a counter for its rank in the launcher's rendezvous store
(torchrun's TCPStore, which `accelerate launch` uses too) while the rank is alive, and watches everyone else's.
A peer whose counter stands still for `train.peer_timeout` seconds is lost: the watcher prints which rank, node,
host and pid it lost and terminates its own rank, so that node's launcher ends the job too (restart every node
with resume=true to continue from the last complete checkpoint).

A process, not a thread: a rank blocked in a collective can hold the GIL (DDP's gradient hook waits with it
held), so a thread could neither beat nor act. A counter, not a clock: hosts need not agree on the time. A rank
that finishes tells its watcher, which sets a "done" key first, so a peer that exits normally is never reported;
a rank that fails (gloo's "Connection closed by peer [address]" names no rank) has its watcher look a few
seconds for the peers that stopped beating and name them before the traceback.
Losing the store itself (it lives in node 0's launcher) counts as losing node 0, after the same grace.
"""

from __future__ import annotations

import datetime
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import time

_GENERATION = itertools.count()  # one per start() in this process: every rank starts the same runs in order


def _tcp_store_address() -> tuple[str, int] | None:
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


class PeerWatch:
    """This rank's watcher process; `close()` when the run ends."""

    def __init__(self, rank: int, world_size: int, timeout: float, node: int | None = None,
                 interval: float = 1.0) -> None:
        self._proc: subprocess.Popen | None = None
        address = _tcp_store_address() if world_size > 1 and timeout > 0 else None
        if address is None:  # one process, the watch off, or a store that is not the launcher's TCPStore
            return
        args = [sys.executable, "-m", "longdoc.train.peers", address[0], str(address[1]),
                f"longdoc/peers/{next(_GENERATION)}/", str(rank), str(world_size), str(timeout), str(interval),
                "" if node is None else str(node), str(os.getpid())]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, text=True)

    @property
    def active(self) -> bool:
        return self._proc is not None

    def close(self, finished: bool = True) -> None:
        """Stop watching. `finished`: this rank ends normally, so peers must not report it lost; otherwise (an
        error) first name the peers that stopped beating, a few seconds' look."""
        if self._proc is None:
            return
        try:
            self._proc.communicate("done\n" if finished else "diagnose\n", timeout=15)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self._proc.kill()
        self._proc = None


def _stop_rank(parent: int) -> None:
    # The rank's main thread is blocked in a collective nothing will complete: end the process itself.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(parent, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            if not _alive(parent):
                return
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _watch(host: str, port: int, prefix: str, rank: int, world: int, timeout: float, interval: float,
           node: str, parent: int) -> int:
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(5.0, timeout / 3)))
    me = f"rank {rank}" + (f" (node {node})" if node else "")
    where = (f"node {node}, " if node else "") + f"host {socket.gethostname()}, pid {parent}"
    store.set(f"{prefix}where/{rank}", where)
    peers = [r for r in range(world) if r != rank]
    seen = {r: (-1, time.monotonic()) for r in peers}  # last counter value, when it last moved
    done: set[int] = set()

    def lost(what: str) -> int:
        print(f"longdoc: {me} lost {what}; that process died or its machine is unreachable. Stopping this rank so "
              f"the launcher ends the job: restart every node with resume=true to continue from the last complete "
              f"checkpoint.", file=sys.stderr, flush=True)
        _stop_rank(parent)
        return 1

    def where_is(r: int) -> str:
        key = f"{prefix}where/{r}"
        try:
            return store.get(key).decode() if store.check([key]) else "it never reported"
        except (RuntimeError, OSError):
            return "unknown"

    while True:
        ready, _, _ = select.select([sys.stdin], [], [], interval)
        if ready:  # the rank is finishing ("done") or stopping after an error ("diagnose")
            if sys.stdin.readline().strip() == "done":
                try:
                    store.set(f"{prefix}done/{rank}", "1")
                except (RuntimeError, OSError):
                    pass
            else:
                _diagnose(store, prefix, f"{prefix}beat/{rank}", [r for r in peers if r not in done], me,
                          max(3.0, 3 * interval), where_is)
            return 0
        if not _alive(parent):
            return 0  # the rank died: no more beats, so its peers report it
        try:
            store.add(f"{prefix}beat/{rank}", 1)
            now = time.monotonic()
            for r in peers:
                if r in done:
                    continue
                if store.check([f"{prefix}done/{r}"]):
                    done.add(r)
                    continue
                value = store.add(f"{prefix}beat/{r}", 0)
                if value != seen[r][0]:
                    seen[r] = (value, now)
                elif now - seen[r][1] > timeout:
                    return lost(f"peer rank {r} ({where_is(r)}): no heartbeat for {now - seen[r][1]:.0f} s "
                                f"(train.peer_timeout={timeout:g})")
        except (RuntimeError, OSError) as e:
            if len(done) == len(peers):
                return 0  # everyone else finished; the store's launcher may have exited with them
            # the store lives in node 0's launcher: give a rank that is merely finishing the same grace
            ready, _, _ = select.select([sys.stdin], [], [], timeout)
            if ready or not _alive(parent):
                return 0
            return lost(f"the rendezvous store at {host}:{port} (node 0's launcher, so node 0 itself): "
                        f"{type(e).__name__}: {e}")


def _diagnose(store, prefix: str, mine: str, peers: list[int], me: str, wait: float, where_is) -> None:
    """The rank failed (a gloo error names a peer by address only): which peers have stopped beating?"""
    try:
        before = {r: store.add(f"{prefix}beat/{r}", 0) for r in peers}
        end = time.monotonic() + wait
        while time.monotonic() < end:  # still beating: peers diagnosing the same failure must see this rank alive
            store.add(mine, 1)
            time.sleep(0.5)
        dead = [r for r in peers if store.add(f"{prefix}beat/{r}", 0) == before[r]
                and not store.check([f"{prefix}done/{r}"])]
    except (RuntimeError, OSError) as e:
        print(f"longdoc: {me} stopped on an error, and the rendezvous store (node 0's launcher) is gone too: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return
    if dead:
        print(f"longdoc: {me} stopped on an error; these peers stopped beating (lost): "
              + "; ".join(f"peer rank {r} ({where_is(r)})" for r in dead)
              + ". Restart every node with resume=true to continue from the last complete checkpoint.",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    h, p, pre, r, w, t, i, n, par = sys.argv[1:]
    raise SystemExit(_watch(h, int(p), pre, int(r), int(w), float(t), float(i), n, int(par)))
