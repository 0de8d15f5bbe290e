"""The Ray backend on a cluster started the way a user starts one, and a node of it killed, or hung, mid-run.

`ray start --head` (no CPUs: it runs no work) and `ray start --address` twice (two worker nodes of 2 CPUs, each its own
raylet and object store), all on this machine, with Ray's token authentication; then `neocfg mode=train
dsi.backend=ray dsi.ray.address=<head>` as a separate process. Once the run delivered part of its first epoch and a
DPP worker actor of the victim node is up (killing a node whose workers were still starting tests nothing of their
replacement), that node's raylet and every process under it are killed (SIGKILL: a host that loses power), or, on a
node added for it, stopped (SIGSTOP: a host that hangs, answering nothing while Ray still counts it alive). The run
must exit 0 and, by its own delivery log (NEOCFG_DPP_AUDIT), deliver every sample exactly once per epoch. And
`dsi.ray.address=null` with that cluster running and RAY_ADDRESS pointing at it: the run starts a Ray of its own and
finishes. The cluster's processes (found by its temp dir) are killed at the end whatever happened.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("ray")

from neocfg.data.dpp.progress import DeliveryLog  # noqa: E402
from neocfg.data.dpp_source import AUDIT_ENV  # noqa: E402
from data_helpers import labeled_ids  # noqa: E402

RAY_CLI = Path(sys.executable).with_name("ray")
OBJECT_STORE_BYTES = 100 * 2**20
# The run: 2 ranks x 64 samples per step over 16 splits of ~500 samples: ~62 steps an epoch, 6 epochs in 400 steps.
SAMPLES, STEPS = 8000, 400
# The node is killed once this many samples went out (a fifth of the first epoch).
KILL_AFTER_SAMPLES = 1500


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(pid)] = (ppid, cmd)
    return out


def _with_descendants(roots: set[int], procs: dict[int, tuple[int, str]]) -> set[int]:
    found, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in procs.items() if ppid == parent and pid not in found]
        found.update(kids)
        frontier += kids
    return found


def _kill(pids: set[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class CliCluster:
    """A Ray cluster of `ray start` nodes on this machine, in a temp dir of its own (short: Ray's socket paths)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nrc", dir="/tmp"))
        self.token = secrets.token_hex(32)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.address = ""
        self.node_ports: list[int] = []

    def _start(self, *args: str) -> None:
        r = subprocess.run([str(RAY_CLI), "start", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}",
                            *args], env=self.env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    def start_head(self) -> None:
        port = _free_port()
        self._start("--head", f"--port={port}", "--num-cpus=0", f"--temp-dir={self.root}",
                    "--include-dashboard=false", f"--dashboard-port={_free_port()}",
                    f"--ray-client-server-port={_free_port()}")
        self.address = f"127.0.0.1:{port}"

    def add_node(self, num_cpus: int) -> int:
        """A worker node; returns its node manager port (which names its raylet)."""
        port = _free_port()
        self._start(f"--address={self.address}", f"--num-cpus={num_cpus}", f"--node-manager-port={port}")
        self.node_ports.append(port)
        return port

    def raylet(self, port: int) -> int | None:
        for pid, (_, cmd) in _processes().items():
            if "raylet/raylet " in cmd and f"--node_manager_port={port} " in cmd and str(self.root) in cmd:
                return pid
        return None

    def dpp_workers(self, port: int) -> list[str]:
        """The node's DPP worker actors that are up (Ray titles an actor's process ray::<Class>[.<method>]; it is
        ray::IDLE before the actor is placed there and ray::DppWorker.__init__ while it starts)."""
        raylet = self.raylet(port)
        if raylet is None:
            return []
        procs = _processes()
        titles = (procs[pid][1] for pid in _with_descendants({raylet}, procs))
        return [t for t in titles if t.startswith("ray::DppWorker") and not t.startswith("ray::DppWorker.__init__")]

    def _node_pids(self, port: int) -> set[int]:
        raylet = self.raylet(port)
        assert raylet is not None, f"no raylet with node manager port {port}"
        return _with_descendants({raylet}, _processes())

    def kill_node(self, port: int) -> set[int]:
        """SIGKILL the node's raylet and every process under it (its workers, its agents)."""
        pids = self._node_pids(port)
        _kill(pids)
        return pids

    def stop_node(self, port: int) -> set[int]:
        """SIGSTOP the node's raylet and every process under it: they hold their sockets open and answer nothing."""
        pids = self._node_pids(port)
        _kill(pids, signal.SIGSTOP)
        return pids

    def shutdown(self) -> None:
        """Kill every process of this cluster: those naming its temp dir, and what runs under them."""
        procs = _processes()
        mine = {pid for pid, (_, cmd) in procs.items() if str(self.root) in cmd and pid != os.getpid()}
        _kill(_with_descendants(mine, procs))
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = CliCluster()
    try:
        c.start_head()
        c.add_node(num_cpus=2)
        c.add_node(num_cpus=2)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_cluster")
    r = subprocess.run([sys.executable, "-m", "neocfg", "mode=gen_data", "dsi=parquet_local", f"dsi.path={root / 'ds'}",
                        f"dsi.num_samples={SAMPLES}", "dsi.eval_samples=500"], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return root / "ds"


def _train(run_dir: Path, dataset: Path, env: dict[str, str], *overrides: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "neocfg", "mode=train", "dsi=parquet_local", f"dsi.path={dataset}",
                             "dsi.backend=ray", "train.batch_size=64", "train.eval_batches=1",
                             "planner.algorithm=greedy", *overrides], cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"the run did not finish in {timeout_s:.0f} s:\n{out[-4000:]}")
    return out


def _delivered(audit: Path) -> int:
    return sum(f.stat().st_size for f in audit.glob("rank*.bin")) // 16


def _run_with_a_node_fault(cluster: CliCluster, dataset: Path, tmp_path: Path, victim: int,
                           fault: Callable[[int], set[int]]) -> tuple[str, dict]:
    """A 2-rank run on the cluster; once it delivered KILL_AFTER_SAMPLES with a DPP worker up on the victim node,
    `fault(victim)` (the pids it hit). Asserts that the run exits 0 and delivered every sample exactly once in every
    epoch but the last two (still under way in a rank's hand); returns its output and metrics."""
    audit = tmp_path / "audit"
    env = {**cluster.env, AUDIT_ENV: str(audit)}
    p = _train(tmp_path / "run", dataset, env, f"dsi.ray.address={cluster.address}", f"train.steps={STEPS}",
               "dsi.workers=4")
    hit: set[int] = set()
    out = ""
    deadline = time.monotonic() + 240
    try:
        while p.poll() is None and not hit and time.monotonic() < deadline:
            if audit.exists() and _delivered(audit) >= KILL_AFTER_SAMPLES and cluster.dpp_workers(victim):
                hit = fault(victim)
            time.sleep(0.1)
        out = _finish(p, max(deadline - time.monotonic(), 1.0))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert hit, (f"the run ended before {KILL_AFTER_SAMPLES} samples went out with a DPP worker up on the victim:\n"
                 f"{out[-3000:]}")
    assert p.returncode == 0, out[-4000:]
    assert f"DPP: joined the Ray cluster at {cluster.address}" in out, out[-3000:]

    logs = [DeliveryLog.read(f) for f in sorted(audit.glob("rank*.bin"))]
    assert len(logs) == 2 and all(len(x) for x in logs)
    pairs = np.concatenate(logs)
    assert len(pairs) >= STEPS * 2 * 64  # every trained batch (and the few fetched ahead)
    want = labeled_ids(dataset)
    epochs = sorted(set(pairs[:, 0].tolist()))
    assert epochs == list(range(len(epochs))) and len(epochs) >= 4, epochs
    m = json.loads(sorted((tmp_path / "run" / "outputs").rglob("metrics.json"))[-1].read_text())
    # (said with a failure: how the run went around the fault)
    story = (f"{len(epochs)} epochs, {m['dpp']['worker_restarts']} worker restarts, "
             f"{m['data']['dpp.splits_reread']} splits re-read, {m['data']['dpp.backups']} backups, "
             f"stall {m['data_stall_fraction']:.1%}")
    for e in epochs:
        ids, counts = np.unique(pairs[pairs[:, 0] == e, 1], return_counts=True)
        assert counts.max() == 1, f"epoch {e}: {int((counts > 1).sum())} samples delivered twice ({story})"
        if e < epochs[-2]:  # the last two epochs may still be under way in a rank's hand
            got = set(ids.tolist())
            lost = sorted(want - got)
            span = f", ids {lost[0]}-{lost[-1]}" if lost else ""
            assert got == want, f"epoch {e}: {len(lost)} samples lost{span} ({story})"
    assert m["duplicate_samples"] == 0
    print(f"{len(hit)} processes of node {victim} hit: {story}, run {m['wall_s']:.0f} s")
    return out, m


def test_a_killed_worker_node_loses_no_sample_and_duplicates_none(cluster, dataset, tmp_path):
    victim = cluster.node_ports[-1]
    out, m = _run_with_a_node_fault(cluster, dataset, tmp_path, victim, cluster.kill_node)
    assert cluster.raylet(victim) is None
    assert "3 node(s)" in out, out[-3000:]
    assert m["dpp"]["worker_restarts"] >= 1, m["dpp"]  # the killed node's workers were replaced


def test_a_hung_worker_node_delays_no_split_and_loses_none(cluster, dataset, tmp_path):
    """SIGSTOP on a worker node's raylet and every process under it: a host that hangs, which no exit code reports
    and which Ray's health checks declare dead only after 15 s or more, longer than this run. The splits its workers
    hold are read again by the live node's workers (backup tasks) and the rows in its object store are handed back
    once their fetch times out, so every epoch but the last two is still delivered whole, within the run."""
    victim = cluster.add_node(num_cpus=2)
    try:
        _, m = _run_with_a_node_fault(cluster, dataset, tmp_path, victim, cluster.stop_node)
    finally:
        cluster.kill_node(victim)
    assert m["data"]["dpp.backups"] >= 1 or m["data"]["dpp.splits_reread"] >= 1, m["data"]


def test_the_runs_own_ray_beside_a_running_cluster(cluster, dataset, tmp_path):
    """dsi.ray.address=null with a cluster running and RAY_ADDRESS (and its token) set, as a cluster's user has:
    the run starts a Ray of its own, never the cluster, and finishes."""
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    p = _train(tmp_path / "run", dataset, env, "train.steps=20")
    out = _finish(p, 240)
    assert p.returncode == 0, out[-4000:]
    said = [line for line in out.splitlines() if line.startswith("DPP: started a Ray of this run's own at ")]
    assert len(said) == 1 and cluster.address.split(":")[1] not in said[0].split(" at ")[1].split()[0], out[-3000:]
    assert "joined the Ray cluster" not in out
