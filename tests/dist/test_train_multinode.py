"""Multi-node `longdoc train`, proven on one machine: two "nodes" of 2 processes each (world 4) against
127.0.0.1, started the way docs/guides/multi-node.md shows (`accelerate launch --machine_rank 0/1` with
recipes/accelerate/cpu-2node.yaml, and `torchrun --nnodes 2 --node-rank 0/1`).

- dp=2 x cp=2: each CP group is one node's two ranks; usp cp=4 (Ulysses 2 inside each node x ring 2 across
  them). Both take the same steps as one process (losses, gradient norms, final weights within 1e-5), and the
  groups the ranks really joined (read back from torch.distributed by tests/dist/multinode_launch.py) sit
  where the docs say.
- SIGKILL of node 1 (its launcher and both ranks) in step 3: node 0 exits within 60 s and names the lost
  peer; restarting both nodes with resume=true continues from the step-2 checkpoint to the same weights as
  one process.

Slow (`make test-slow`): every launch starts 6 Python processes (2 launchers, 4 ranks), a few minutes per test
on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from tests.support.training import max_rel_err, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(tmp: Path, name: str, steps: int = 3) -> Path:
    r = tiny_recipe(tmp / name, train={"steps": steps, "comm_timeout": 60.0})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _node_cmd(launcher: str, node: int, port: int) -> list[str]:
    """The per-node launch command of docs/guides/multi-node.md, both nodes on 127.0.0.1."""
    if launcher == "accelerate":
        return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "recipes/accelerate/cpu-2node.yaml"),
                "--machine_rank", str(node), "--main_process_port", str(port)]
    # torchrun is `python -m torch.distributed.run` (a venv's torch may ship without the script)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _start_nodes(tmp: Path, launcher: str, recipe: Path, overrides: list[str], stall: int = 0):
    """Both nodes' launchers; (procs, record dir, log files)."""
    record = tmp / f"record-{time.monotonic_ns()}"
    record.mkdir()
    port = _free_port()
    procs, logs = [], []
    for node in (0, 1):
        log = record / f"node{node}.log"
        cmd = [*_node_cmd(launcher, node, port), "-m", "tests.dist.multinode_launch", str(record), str(stall),
               "train", str(recipe), *overrides]
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, record, logs


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher and every process under it (torchrun starts its ranks in sessions of their
    own, so the launcher's process group alone would leave them running)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def _wait_all(procs, logs, limit: float = 900) -> None:
    try:
        for p in procs:
            p.wait(timeout=limit)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_node(p)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log.read_text()[-4000:]


def _single_process(tmp: Path, recipe: Path) -> tuple[list[dict], dict]:
    """The reference: the same recipe in one process (parallelism.cp_size=1, the 2 sequences of a step accumulated)."""
    out = subprocess.run([sys.executable, "-m", "longdoc", "train", str(recipe), "parallelism.cp_size=1"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return _run_output(Path(yaml.safe_load(recipe.read_text())["output_dir"]))


def _run_output(out: Path) -> tuple[list[dict], dict]:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(out / "final" / "model.safetensors")


def _assert_same_run(got: tuple[list[dict], dict], ref: tuple[list[dict], dict]) -> float:
    (metrics, weights), (ref_metrics, ref_weights) = got, ref
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics]
    for m, m0 in zip(metrics, ref_metrics, strict=True):
        assert m["tokens"] == m0["tokens"], (m, m0)
        assert m["loss"] == pytest.approx(m0["loss"], rel=1e-5, abs=1e-6), (m, m0)
        assert m["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5), (m, m0)
    err = max_rel_err(weights, ref_weights)
    assert err <= 1e-5, err
    return err


def _records(record: Path) -> dict[int, dict]:
    recs = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in record.glob("rank-*.json")}
    assert sorted(recs) == [0, 1, 2, 3], recs
    for r, rec in recs.items():  # node k holds ranks 2k, 2k+1: the launcher's own rank order
        assert (rec["node"], rec["local_rank"]) == divmod(r, 2), rec
    return recs


def test_two_nodes_dp2_cp2_and_usp_cp4_equal_single_process(tmp_path):
    ref = _single_process(tmp_path, _recipe(tmp_path, "single"))
    # dp=2 x cp=2: each CP group is one node
    recipe = _recipe(tmp_path, "dp2cp2")
    procs, record, logs = _start_nodes(tmp_path, "accelerate", recipe, ["parallelism.cp_size=2"])
    _wait_all(procs, logs)
    for rec in _records(record).values():
        assert rec["cp"] == [2 * rec["node"], 2 * rec["node"] + 1], rec  # inside the rank's own node
        assert rec["ulysses"] is None and rec["ring"] is None
    _assert_same_run(_run_output(tmp_path / "dp2cp2"), ref)
    # usp cp=4: Ulysses pairs inside a node, the ring across the nodes
    recipe = _recipe(tmp_path, "usp")
    procs, record, logs = _start_nodes(tmp_path, "accelerate", recipe, ["parallelism.cp_size=4",
                                                                        "parallelism.strategy=usp",
                                                                        "parallelism.ulysses_size=2"])
    _wait_all(procs, logs)
    for rec in _records(record).values():
        node, local = rec["node"], rec["local_rank"]
        assert rec["cp"] == [0, 1, 2, 3]
        assert rec["ulysses"] == [2 * node, 2 * node + 1], rec  # the all-to-all stays inside the node
        assert rec["ring"] == [local, local + 2], rec  # the ring crosses the nodes
    _assert_same_run(_run_output(tmp_path / "usp"), ref)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(paths: list[Path], procs, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert all(p.poll() is None for p in procs), "a node stopped before the kill"
        assert time.monotonic() < deadline, f"not reached in {limit} s: {[str(p) for p in paths]}"
        time.sleep(0.5)


def test_sigkill_of_one_node_stops_the_other_and_both_resume_exactly(tmp_path):
    recipe = _recipe(tmp_path, "run", steps=4)
    ref = _single_process(tmp_path, _recipe(tmp_path, "single", steps=4))
    out = tmp_path / "run"
    ck = ["parallelism.cp_size=2", "checkpoint.every=2", "checkpoint.export=true"]
    procs, record, logs = _start_nodes(tmp_path, "torchrun", recipe, ck, stall=3)
    try:
        _wait_for([record / "stalled-2", record / "stalled-3", out / "checkpoints" / "step-00000002"], procs, 600)
        survivors = psutil.Process(procs[0].pid).children(recursive=True)
        killed = time.monotonic()
        _kill_node(procs[1])  # node 1: its launcher, both ranks and everything they started, at once
        procs[0].wait(timeout=120)
        seconds = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_node(p)
    text = logs[0].read_text()
    assert procs[0].returncode != 0, text[-4000:]
    assert seconds < 60, f"node 0 exited {seconds:.0f} s after node 1 was killed"
    assert not [p.pid for p in survivors if _alive(p.pid)], "a process of node 0 outlived its launcher"
    # longdoc.train.peers: a survivor names the lost ranks of node 1 with their node, host and pid, whether its
    # collective failed at once (gloo saw the connection close) or its watcher's heartbeat timeout fired first
    lost = r"peer rank {} \(node 1, host \S+, pid \d+\)"
    assert re.search(r"rank [01] \(node 0\) (stopped on an error; these peers stopped beating \(lost\): "
                     + lost.format(2) + "; " + lost.format(3) + "|lost " + lost.format("[23]") + ": no heartbeat)",
                     text), text[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    # both nodes again, resume=true: steps 3 and 4 from the step-2 checkpoint, the same run as one process
    procs, record, logs = _start_nodes(tmp_path, "torchrun", recipe, [*ck, "resume=true"])
    _wait_all(procs, logs)
    _assert_same_run(_run_output(out), ref)
