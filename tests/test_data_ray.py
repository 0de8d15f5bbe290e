"""The Ray DPP backend. One job-wide master actor, 2 trainer clients x 2 worker actors: every sample goes
to exactly one client per epoch (counted by sample_id, job-wide) although a busy worker actor is ray.kill-ed and the
trainers restart from a checkpoint (batches taken after it are lost with them and delivered again); and
`neocfg mode=train dsi=parquet_local dsi.backend=ray` end to end."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from neocfg.data.dpp.ray_backend import (RayDppService, RayOptions, WorkerResources, leave_ray,  # noqa: E402
                                         start_local_ray)
from neocfg.data.dpp.service import DppService  # noqa: E402
from neocfg.types import Mode  # noqa: E402
from data_helpers import drain, labeled_ids, make_dataset, setup_for  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(object_store_mb=256, num_cpus=2, namespace="neocfg-test")
    yield
    leave_ray()


def _job(setup, name: str) -> list[DppService]:
    """Two trainer ranks' services on one master actor (rank 0 creates it, rank 1 finds it by name)."""
    opts = RayOptions(namespace="neocfg-test", master_name=name, owner=True,
                      resources=WorkerResources(cpus=0.5, memory_bytes=2**28))
    return [DppService(setup, clients=[c], backend=RayDppService(setup, replace(opts, owner=c == 0, client=c))).start()
            for c in (0, 1)]


def _take(services: list[DppService], n: int) -> list[np.ndarray]:
    return [s.clients[0].next_arrays().sample_ids for _ in range(n) for s in services]


def _close(services: list[DppService]) -> None:
    for s in reversed(services):  # rank 1 leaves, then rank 0 stops the master
        s.close()


def test_exactly_once_job_wide_under_a_killed_worker_actor_and_a_restarted_trainer(local_ray, tmp_path):
    cfg = make_dataset(tmp_path / "ds")
    setup = setup_for(cfg, workers=2, num_clients=2, extra_split_s=0.2)
    job = _job(setup, "job-a")
    got = _take(job, 4)
    victim = job[0].backend.worker_handles(busy_only=True)[0]
    ray.kill(victim, no_restart=True)
    got += _take(job, 6)
    with ThreadPoolExecutor(2) as pool:  # every rank checkpoints after the same step
        positions = list(pool.map(lambda s: s.position(), job))
    assert positions[0].to_state() == positions[1].to_state()
    lost = _take(job, 3)  # taken after the checkpoint: lost with the trainers that restart
    stats = job[0].stats()
    _close(job)
    assert stats.worker_restarts == 1 and stats.workers == 2

    resumed = _job(replace(setup, start=positions[0]), "job-b")
    got += _take(resumed, 2)
    ray.kill(resumed[0].backend.worker_handles(busy_only=True)[0], no_restart=True)  # again, with no restart after
    got += drain([s.clients[0] for s in resumed])
    per_client = [s.clients[0].delivered for s in resumed]
    assert resumed[0].stats().worker_restarts == 1
    _close(resumed)
    ids = np.concatenate(got)
    values, counts = np.unique(ids, return_counts=True)
    assert counts.max() == 1, f"{int((counts > 1).sum())} samples delivered twice"
    assert set(values.tolist()) == labeled_ids(Path(cfg.dsi.path)), "a sample was lost"
    assert set(np.concatenate(lost).tolist()) <= set(values.tolist())
    assert min(per_client) > 0  # both trainers were fed after the restart


@pytest.mark.skipif(not hasattr(Mode, "train"), reason="mode=train (the runtime) is not in this build")
def test_train_with_the_ray_backend(cli, tmp_path):
    r = cli("mode=gen_data", "dsi=parquet_local", "dsi.path=ds", "dsi.num_samples=4000", "dsi.eval_samples=500")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    r = cli("mode=train", "dsi=parquet_local", "dsi.path=ds", "dsi.backend=ray", "train.steps=6",
            "train.batch_size=64", "train.eval_batches=1", "planner.algorithm=greedy", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(sorted((tmp_path / "outputs").rglob("metrics.json"))[-1].read_text())
    assert m["duplicate_samples"] == 0 and m["samples_delivered"] == 2 * 6 * 64
    assert 0.0 <= m["data_stall_fraction"] <= 1.0
    assert m["dpp"]["backend"] == "ray" and m["dpp"]["workers"] >= 1 and m["dpp"]["worker_restarts"] == 0
    assert m["dpp"]["bytes_read"] > 0
    # The planned worker host (64 CPUs) does not fit this machine's local Ray: scaled down, said once.
    assert r.stdout.count("Ray worker actor(s) of 64 CPUs each") == 1, r.stdout
    assert r.stdout.count("warning: DPP worker shape cpu_host_64c asks 64 CPUs") == 1, r.stdout
    assert r.stdout.count("DPP: started a Ray of this run's own at ") == 1, r.stdout  # which Ray it used
    assert "Traceback" not in r.stderr
    print(f"ray train run: {time.monotonic() - t0:.0f} s")


def test_ranks_fetch_without_waiting_for_each_other_and_checkpoint_a_look_ahead_mark(local_ray, dataset_ray):
    """Rank 0 takes (and marks) many batches while rank 1 takes none: no per-batch barrier. At the checkpoint each
    rank hands in the mark taken before its look-ahead batches (a pipelined trainer's), and the resumed job delivers
    the look-ahead batches again and every other sample exactly once."""
    from neocfg.data.dpp.sizing import WorkerCount, WorkerCountSource
    from neocfg.data.dpp_source import DppSource, STATE_KEY
    from neocfg.data.dpp.progress import Position
    from neocfg.types import DppBackendKind

    cfg = dataset_ray
    setup = setup_for(cfg, workers=2, num_clients=2, limits={"stall_timeout_s": 30.0})
    opts = RayOptions(namespace="neocfg-test", master_name="job-marks", owner=True,
                      resources=WorkerResources(cpus=0.5, memory_bytes=2**28))
    count = WorkerCount(2, 2, WorkerCountSource.fixed)
    srcs = [DppSource(setup, DppBackendKind.ray, count, client=c,
                      options=replace(opts, owner=c == 0, client=c)) for c in (0, 1)]
    trained: list[np.ndarray] = []
    marks = []
    try:
        for s in srcs:  # a trainer marks before every batch; rank 1 takes nothing until rank 0 took 14
            for _ in range(14):
                s.mark()
                trained.append(s.next_batch().sample_ids.numpy())
        for s in srcs:
            marks.append(s.mark())
            for _ in range(2):  # fetched ahead, never trained: a resume delivers them again
                s.next_batch()
        with ThreadPoolExecutor(2) as pool:
            states = list(pool.map(lambda sm: sm[0].state_at(sm[1]), zip(srcs, marks)))
    finally:
        for s in reversed(srcs):
            s.close()
    assert states[0] == states[1]
    pos = Position.from_state(states[0][STATE_KEY])
    resumed = _job(replace(setup, start=pos), "job-marks-b")
    got = drain([s.clients[0] for s in resumed])
    _close(resumed)
    ids = np.concatenate(trained + got)
    values, counts = np.unique(ids, return_counts=True)
    assert counts.max() == 1, f"{int((counts > 1).sum())} samples delivered twice"
    assert set(values.tolist()) == labeled_ids(Path(cfg.dsi.path)), "a sample was lost"


@pytest.fixture
def dataset_ray(tmp_path):
    return make_dataset(tmp_path / "ds")


def test_the_master_keeps_no_rows_of_the_splits_it_served(local_ray, tmp_path):
    """Three epochs of 120 small splits through the job's master actor: afterwards its in-process memory store holds
    a few objects, not one split's rows per split served (what it held when it owned its workers' returns)."""
    cfg = make_dataset(tmp_path / "ds", "dsi.num_samples=7200", "dsi.num_files=4", "dsi.row_groups_per_file=30")
    setup = setup_for(cfg, workers=2, num_clients=1, max_epochs=3)
    assert len(setup.splits) == 120
    opts = RayOptions(namespace="neocfg-test", master_name="job-rows", owner=True,
                      resources=WorkerResources(cpus=0.5, memory_bytes=2**28))
    svc = DppService(setup, clients=[0], backend=RayDppService(setup, opts)).start()
    try:
        ids = np.concatenate(drain(svc.clients))
        objects, held = ray.get(svc.backend.master.held_objects.remote())
        splits = svc.stats().splits_done
    finally:
        svc.close()
    assert splits == 360 and len(ids) == 3 * len(labeled_ids(Path(cfg.dsi.path)))
    split_bytes = ids.nbytes // splits  # a split's sample ids alone; its rows are many times that
    assert objects <= 8 and held < split_bytes * 8, f"the master holds {objects} objects, {held:,} bytes"


def test_scaled_down_workers_fit_on_the_nodes_not_only_in_the_totals():
    """Two nodes of 2 CPUs and 23.1 GiB each (and a head without CPUs), 4 workers of a 64-CPU, 256-GiB shape: an
    even share of the cluster's totals (11.55 GiB) would fit one worker per node; every worker must fit where it is
    placed."""
    from neocfg.data.dpp.ray_backend import fit_workers
    from neocfg.data.dpp.sizing import PlannedDpp

    gib = 2**30
    big = PlannedDpp(hosts=1, shape="1 x cpu_host_64c", cores_per_host=64.0, memory_gib_per_host=256.0)

    def placed(res, nodes):
        return sum(min(int(n.get("CPU", 0) // res.cpus), int(n["memory"] // res.memory_bytes)) for n in nodes)

    for nodes in ([{"CPU": 2.0, "memory": 23.1 * gib}, {"CPU": 2.0, "memory": 23.1 * gib}, {"memory": 8.0 * gib}],
                  [{"CPU": 1.0, "memory": 4.0 * gib}, {"CPU": 3.0, "memory": 30.0 * gib}]):
        res, warning = fit_workers(big, 4, nodes)
        assert placed(res, nodes) >= 4, (res, nodes)
        assert warning.startswith("warning: DPP worker shape cpu_host_64c asks 64 CPUs and 256 GiB per worker")
    assert fit_workers(None, 2, [{"CPU": 8.0, "memory": 64.0 * gib}]) == (WorkerResources(1.0, gib), "")


def test_a_worker_that_dies_with_no_split_is_found_and_reported_gone(local_ray, tmp_path):
    """Two worker actors, both ready and idle; one's process is SIGKILLed. The pool reports it gone within a few
    seconds although it was never sent a split (a dead idle worker was noticed only when a split went to it: with the
    buffer full the first idle workers get every split, and a killed node's workers could go unnoticed to the end)."""
    import os
    import signal

    from neocfg.data.dpp.loop import EventKind
    from neocfg.data.dpp.ray_backend import RayPool

    setup = setup_for(make_dataset(tmp_path / "ds"), workers=2)
    pool = RayPool(setup.spec, WorkerResources(cpus=0.5, memory_bytes=2**28))
    try:
        wids = [pool.spawn(), pool.spawn()]
        ready: set[int] = set()
        deadline = time.monotonic() + 60
        while ready != set(wids) and time.monotonic() < deadline:
            ready |= {e.wid for e in pool.poll(0.1) if e.kind is EventKind.ready}
        assert ready == set(wids)
        os.kill(ray.get(pool.handles[wids[1]].pid.remote()), signal.SIGKILL)
        events = []
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:
            events = pool.poll(0.1)
        assert [(e.kind, e.wid) for e in events] == [(EventKind.gone, wids[1])], events
        assert "idle check" in events[0].message and list(pool.handles) == [wids[0]]
        quiet = [pool.poll(0.1) for _ in range(30)]  # the live one answers its checks: nothing to report
        assert not any(quiet)
    finally:
        pool.close()
