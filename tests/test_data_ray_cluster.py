"""The Ray DPP backend on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head node and a
second node, each its own raylet and object store): the second node is removed mid-epoch (its raylet and workers
killed) while worker actors on it hold splits and its object store holds finished rows; the job still delivers every
sample exactly once per epoch. And the run's own Ray (dsi.ray.address=null) beside a running cluster: it starts its
own (never joins), and every socket of it that listens beyond loopback requires the run's token."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from neocfg.data.dpp.ray_backend import (AUTH_MODE_ENV, RayDppService, RayOptions, WorkerResources,  # noqa: E402
                                         set_ray_auth, leave_ray, start_local_ray)
from neocfg.data.dpp.service import DppService  # noqa: E402
from data_helpers import drain, labeled_ids, make_dataset, setup_for  # noqa: E402

NS = "neocfg-cluster-test"


@pytest.fixture
def two_nodes():
    """A head node (1 CPU) and a second node (2 CPUs); this process is the driver. Always shut down."""
    set_ray_auth({AUTH_MODE_ENV: "disabled"})  # a plain test cluster: no token (the run's own Ray has one)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 96 * 2**20,
                                                            "include_dashboard": False})
    try:
        second = cluster.add_node(num_cpus=2, object_store_memory=96 * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NS, log_to_driver=False)
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()
        set_ray_auth({AUTH_MODE_ENV: None})


def _job(setup, name: str) -> list[DppService]:
    opts = RayOptions(namespace=NS, master_name=name, owner=True,
                      resources=WorkerResources(cpus=1.0, memory_bytes=2**27))
    return [DppService(setup, clients=[c], backend=RayDppService(setup, replace(opts, owner=c == 0, client=c))).start()
            for c in (0, 1)]


def _worker_nodes(service: DppService) -> list[str]:
    handles = service.backend.worker_handles()
    return [ray.get(h.node.remote(), timeout=30) for h in handles]


def test_a_lost_node_loses_no_sample_and_duplicates_none(dataset_dir, two_nodes):
    cluster, second = two_nodes
    setup = setup_for(dataset_dir, workers=3, num_clients=2, max_epochs=2, extra_split_s=0.3)
    job = _job(setup, "job-lost-node")
    got: list[np.ndarray] = []
    try:
        for _ in range(2):
            got += [s.clients[0].next_arrays().sample_ids for s in job]
        time.sleep(2.0)  # the workers fill the buffer: finished rows wait in the second node's object store
        on_second = _worker_nodes(job[0]).count(second.node_id)
        assert on_second >= 2, "the head has 1 CPU: two of the three 1-CPU workers run on the second node"
        cluster.remove_node(second, allow_graceful=False)
        got += drain([s.clients[0] for s in job])
        stats = job[0].stats()
        rereads = sum(s.backend.rereads for s in job)
    finally:
        for s in reversed(job):
            s.close()
    values, counts = np.unique(np.concatenate(got), return_counts=True)
    assert set(values.tolist()) == labeled_ids(Path(dataset_dir.dsi.path)), "a sample was lost"
    assert (counts == 2).all(), f"{int((counts != 2).sum())} samples not delivered exactly once per epoch"
    assert stats.worker_restarts >= 2  # the second node's workers died and were replaced (or tried to be)
    assert stats.splits_reread == rereads
    print(f"lost node: {on_second} workers, {stats.worker_restarts} restarts, {rereads} splits re-read")


@pytest.fixture
def dataset_dir(tmp_path):
    return make_dataset(tmp_path / "ds")


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of the TCP sockets these processes listen on, from /proc (IPv4 and IPv6)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(addr_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian 32-bit words
            out.append((socket.inet_ntop(family, raw), int(port_hex, 16), inodes[f[9]]))
    return out


def _session_pids(session_dir: str) -> set[int]:
    """Processes of one Ray session: those whose command line names its directory, and the driver."""
    name = os.path.basename(session_dir)
    pids = {os.getpid()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


def test_the_runs_own_ray_beside_a_running_cluster_is_its_own_and_needs_its_token(two_nodes, tmp_path):
    """A cluster runs (and RAY_ADDRESS points at it, as `ray start --head` users have): dsi.ray.address=null still
    starts the run's own Ray, and a driver without the run's token cannot join it."""
    import subprocess
    import sys

    cluster, _ = two_nodes
    ray.shutdown()  # this process leaves the cluster, which keeps running
    set_ray_auth({AUTH_MODE_ENV: None})
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        address, token = start_local_ray(object_store_mb=96, num_cpus=1, namespace=NS)
        assert address != cluster.address and ray.cluster_resources().get("CPU") == 1.0
        session = ray._private.worker.global_worker.node.get_session_dir_path()

        @ray.remote(num_cpus=0)
        def pid() -> int:
            return os.getpid()

        ray.get(pid.remote())  # a worker process is up too
        sockets = _listening(_session_pids(session))
        assert sockets, "found no listening socket of the run's Ray"
        wide = [s for s in sockets if s[0] not in ("127.0.0.1", "::1")]
        # Ray binds its servers to every interface: each of them must refuse a driver without the token.
        probe = ("import ray, sys\n"
                 "try:\n    ray.init(address=sys.argv[1]); print('JOINED')\n"
                 "except Exception as e:\n    print('REFUSED', type(e).__name__)\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        r = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=120,
                           env={**env, AUTH_MODE_ENV: "disabled"})
        assert "REFUSED" in r.stdout and "JOINED" not in r.stdout, r.stdout + r.stderr[-2000:]
        for host, port, _ in wide:  # HTTP servers (the runtime-env agent) answer 401 without the token
            try:
                with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port), 3) as c:
                    c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    head = c.recv(64)
            except OSError:
                continue
            if head.startswith(b"HTTP/"):
                assert b" 401 " in head or b" 403 " in head, (host, port, head)
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        leave_ray()
