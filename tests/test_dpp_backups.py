"""Backup tasks: a split whose worker straggles (a hung process or host) is read again by an idle worker; the first
result is delivered and the other dropped, so nothing is delivered twice and nothing waits for the straggler.
The policy on the Master alone, then a worker process stopped with SIGSTOP in a running local service."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from neocfg.data.dataset import Split
from neocfg.data.dpp.master import Master, ServiceSetup
from neocfg.data.dpp.progress import SplitMeta, Task
from neocfg.data.dpp.service import DppService
from neocfg.data.dpp.worker import WorkerSpec
from data_helpers import busy_worker, drain, labeled_ids, make_dataset, setup_for

SPLITS = tuple(Split(index=i, path=f"part-{i}.parquet", row_group=0, rows=100) for i in range(4))


def _master(max_epochs: int = 1) -> Master:
    spec = WorkerSpec(columns=None, transforms=(), batch_size=10)  # type: ignore[arg-type]
    return Master(ServiceSetup(splits=SPLITS, spec=spec, workers=4, seed=0, max_epochs=max_epochs))


def _meta(task: Task, seconds: float = 0.05) -> SplitMeta:
    return SplitMeta(task=task, rows=100, delivered_rows=100, bytes_read=1000, seconds=seconds)


def _key(task: Task) -> tuple[int, int]:
    return task.epoch, task.split.index


def _delivered(m: Master) -> list[tuple[int, int]]:
    out = []
    while (got := m.take()) is not None:
        out.append(_key(got[0].task))
    return out


def _with_a_straggler(m: Master) -> Task:
    """Worker 0 takes a split at t=0 and holds it; worker 1 reads one in 50 ms (the median the rule judges by)."""
    slow = m.lease(0, 0.0)
    quick = m.lease(1, 0.0)
    m.complete(1, _meta(quick), "rows")
    return slow


def _backup(m: Master, slow: Task, worker: int = 2, now: float = 1.5) -> None:
    assert _key(m.lease(worker, now)) == _key(slow), "the straggler's split was not given to the idle worker"


def test_a_lease_past_the_threshold_goes_to_the_next_idle_worker_once():
    m = _master()
    slow = _with_a_straggler(m)
    early = m.lease(2, 0.9)  # under the floor (1 s): a new split, not a backup
    assert _key(early) != _key(slow)
    backup = m.lease(3, 1.5)
    assert _key(backup) == _key(slow) and m.counters.backups == 1
    m.complete(2, _meta(early), "rows")
    again = m.lease(2, 2.0)  # the straggler has its backup already: a new split
    assert _key(again) not in {_key(slow), _key(early)} and m.counters.backups == 1


def test_no_backup_before_a_split_finished_to_judge_by():
    m = _master()
    slow = m.lease(0, 0.0)
    assert _key(m.lease(1, 100.0)) != _key(slow) and m.counters.backups == 0


def test_the_first_result_is_delivered_and_the_second_dropped():
    m = _master()
    slow = _with_a_straggler(m)
    _backup(m, slow)
    m.complete(2, _meta(slow), "backup rows")
    m.complete(0, _meta(slow, seconds=30.0), "straggler rows")
    got = _delivered(m)
    assert got.count(_key(slow)) == 1 and m.counters.backups_dropped == 1
    assert not m.served  # nothing of it is remembered once both leases ended


def test_a_straggler_that_dies_after_its_backup_delivered_requeues_nothing():
    m = _master()
    slow = _with_a_straggler(m)
    _backup(m, slow)
    m.complete(2, _meta(slow), "rows")
    assert m.lost(0, "its host hung")
    rest = [m.lease(3, 2.0), m.lease(3, 2.0)]  # the two splits left of the epoch, then nothing
    assert [_key(t) for t in rest if t is not None].count(_key(slow)) == 0
    assert m.counters.worker_restarts == 1 and m.attempts == {}


def test_a_straggler_that_dies_while_its_backup_reads_requeues_nothing_and_the_backup_delivers():
    m = _master()
    slow = _with_a_straggler(m)
    _backup(m, slow)
    m.lost(0, "its host hung")
    assert m.queue.todo and all(_key(t) != _key(slow) for t in m.queue.todo)
    m.complete(2, _meta(slow), "rows")
    assert _delivered(m).count(_key(slow)) == 1 and m.counters.backups_dropped == 0


def test_rows_lost_after_the_backup_delivered_are_taken_from_the_straggler():
    m = _master()
    slow = _with_a_straggler(m)
    _backup(m, slow)
    m.complete(2, _meta(slow), "rows")
    _delivered(m)
    m.reread(slow, "the rows' node is gone")  # the client could not fetch the backup's rows
    assert all(_key(t) != _key(slow) for t in m.queue.todo)  # not queued: the straggler still reads it
    m.complete(0, _meta(slow, seconds=30.0), "straggler rows")
    assert _delivered(m) == [_key(slow)] and m.counters.backups_dropped == 0


def test_a_finite_service_ends_without_waiting_for_a_straggler_whose_backup_delivered():
    m = _master()
    slow = _with_a_straggler(m)
    _backup(m, slow)
    m.complete(2, _meta(slow), "rows")
    now = 2.0
    while (t := m.lease(3, now)) is not None:
        m.complete(3, _meta(t), "rows")
    _delivered(m)
    assert 0 in m.leases and m.finished


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("backups") / "ds")


def test_a_stopped_worker_delays_nothing_and_loses_nothing(dataset):
    """SIGSTOP (a process or host that hangs, which no exit code reports) on a worker holding a split: its split
    is read again by the other worker well before split_timeout_s would kill the stopped one."""
    timeout_s = 60.0
    setup = setup_for(dataset, workers=2, num_clients=2, extra_split_s=0.1,
                      limits={"prefetch_splits": 1, "split_timeout_s": timeout_s})
    with DppService(setup) as svc:
        first = [c.next_arrays().sample_ids for c in svc.clients]
        backend = svc.backend
        os.kill(backend.pool.pid(busy_worker(backend)), signal.SIGSTOP)
        stopped_at = time.monotonic()
        rest = drain(svc.clients)
        took = time.monotonic() - stopped_at
        stats = svc.stats()
    ids = np.concatenate(first + rest)
    assert len(ids) == len(set(ids.tolist())), "a sample was delivered twice"
    assert set(ids.tolist()) == labeled_ids(Path(dataset.dsi.path)), "a sample was lost"
    assert stats.backups >= 1 and stats.worker_restarts == 0, stats  # read again, not killed as overdue
    assert took < timeout_s / 2, f"the run waited {took:.1f} s for the stopped worker"
