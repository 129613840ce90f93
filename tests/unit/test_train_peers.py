"""The lost-peer watcher (longdoc.train.peers) against a real TCPStore, in seconds: a silent peer is named and
the watcher's rank stopped; a finished peer is never reported; a failing rank gets the silent peers named.
The two-node runs themselves: tests/dist/test_train_multinode.py (slow)."""

from __future__ import annotations

import subprocess
import sys
import time

import torch.distributed as dist


def _watcher(store, rank_pid: int, prefix: str, timeout: float = 2.0) -> subprocess.Popen:
    w = subprocess.Popen([sys.executable, "-m", "longdoc.train.peers", "127.0.0.1", str(store.port), prefix, "0",
                          "2", str(timeout), "0.2", "0", str(rank_pid)],
                         stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # its start-up (importing torch) takes seconds on a loaded machine
    while not store.check([f"{prefix}beat/0"]):
        assert w.poll() is None and time.monotonic() < deadline, "the watcher did not start"
        time.sleep(0.1)
    return w


def _rank() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _beat(store, prefix: str, seconds: float) -> None:
    store.set(f"{prefix}where/1", "node 1, host h1, pid 4242")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        store.add(f"{prefix}beat/1", 1)
        time.sleep(0.2)


def test_silent_peer_is_named_and_the_rank_stopped():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank = _rank()
    try:
        watcher = _watcher(store, rank.pid, "a/")
        _beat(store, "a/", 3.0)  # alive for a while, then silent (a killed node)
        silent = time.monotonic()
        assert rank.wait(timeout=30) == -15  # SIGTERM from the watcher
        assert time.monotonic() - silent < 20  # timeout 2 s, plus a loaded machine's scheduling
        err = watcher.communicate(timeout=30)[1]
        assert "rank 0 (node 0) lost peer rank 1 (node 1, host h1, pid 4242): no heartbeat for 2 s" in err, err
        assert watcher.returncode == 1
    finally:
        rank.kill()


def test_finished_peer_is_not_reported_and_a_finished_rank_says_so():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank = _rank()
    try:
        watcher = _watcher(store, rank.pid, "b/")
        _beat(store, "b/", 1.0)
        store.set("b/done/1", "1")  # the peer ended normally, then its process went away
        time.sleep(4)  # twice the timeout
        assert rank.poll() is None and watcher.poll() is None
        _, err = watcher.communicate("done\n", timeout=30)
        assert watcher.returncode == 0 and "lost" not in err, err
        assert store.check(["b/done/0"])  # so its peers will not report it either
    finally:
        rank.kill()


def test_a_failing_rank_gets_the_silent_peers_named():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank = _rank()
    try:
        watcher = _watcher(store, rank.pid, "c/", timeout=60.0)  # far from its own timeout
        _beat(store, "c/", 1.0)
        _, err = watcher.communicate("diagnose\n", timeout=30)  # the rank's collective just failed
        assert ("rank 0 (node 0) stopped on an error; these peers stopped beating (lost): peer rank 1 (node 1, "
                "host h1, pid 4242)") in err, err
        assert rank.poll() is None  # the rank raises its own error; the watcher only names the peers
    finally:
        rank.kill()
