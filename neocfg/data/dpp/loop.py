"""The one DPP worker loop, over any transport's pool of workers.

A transport is a WorkerPool: it spawns a worker, sends it a task, polls for what its workers did (ready, a split
done, a split failed, a worker gone), and kills a worker. ServiceLoop runs the Master policy (master.py) over a pool
in a thread of its own, the same for every backend: it hands tasks to idle ready workers while the buffer has room,
buffers finished splits for the clients, requeues the split of a worker that died (and starts a replacement), kills
a worker busy past split_timeout_s, and scales the pool (dsi.autoscale). Clients call `pull` from their own threads.

Backends built on it: `local` (worker processes: neocfg/data/dpp/local.py), `ray` (worker actors under the job's
master actor: ray_backend.py); InProcessService is the DppBackend of a loop that runs in the trainer's process (one
service per rank), which a new per-rank backend needs only a pool for (neocfg/data/dpp/backends/).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Optional, Protocol

from neocfg.data.dpp.backend import merge_records
from neocfg.data.dpp.master import DataStall, DppStats, Master, ServiceSetup, autoscale_step
from neocfg.data.dpp.progress import Consumed, Finished, Position, SplitMeta, Task
from neocfg.data.dpp.worker import SplitResult
from neocfg.errors import DataError


class EventKind(Enum):
    ready = "ready"    # the worker started and takes tasks
    done = "done"      # it finished its split: meta and payload
    failed = "failed"  # its split raised: message
    gone = "gone"      # it exited, was killed or lost with its host: message says why


@dataclass(frozen=True)
class PoolEvent:
    kind: EventKind
    wid: int
    meta: Optional[SplitMeta] = None
    payload: Any = None  # done: what a client gets (a SplitResult, or an object-store reference to it)
    message: str = ""


class WorkerPool(Protocol):
    """A transport's workers. Called by the loop's thread only (spawn, send and kill also under the loop's lock)."""

    # The workers, in messages ("worker processes", "Ray worker actors").
    what: str

    def spawn(self) -> int:
        """Start a worker; returns its id. It reports `ready` through poll once it takes tasks."""
        ...

    def send(self, wid: int, task: Task) -> None:
        """Give a ready, idle worker a task (a dead one reports `gone` through poll)."""
        ...

    def poll(self, timeout_s: float) -> list[PoolEvent]:
        """What happened since the last poll, waiting up to timeout_s for something to."""
        ...

    def kill(self, wid: int) -> None:
        """Stop this worker now and forget it (the loop requeues its task, if any)."""
        ...

    def close(self) -> None:
        """Stop every worker."""
        ...


@dataclass
class Slot:
    """The loop's record of one worker (master.WorkerSlot)."""

    wid: int
    ready: bool = False
    retiring: bool = False
    task: Optional[Task] = None


@dataclass(frozen=True)
class WorkerDeath:
    """A worker the loop found gone: when (time.monotonic()), which, why."""

    noticed_at: float
    wid: int
    reason: str


@dataclass(frozen=True)
class Pulled:
    """A finished split handed to a client, with the epochs complete job-wide below complete_below."""

    meta: SplitMeta
    payload: Any  # None: a skipped split
    complete_below: int


class ServiceLoop:
    """The Master, the pool's workers and the clients' pulls; `self.cond` guards the Master and the slots.

    `tick_s`: the loop wakes at least this often (timeouts, scaling, stop); `wake_s`: a client blocked in pull is
    woken by every change it waits for and also this often (a safety net)."""

    def __init__(self, setup: ServiceSetup, pool: WorkerPool, tick_s: float, wake_s: float) -> None:
        self.setup, self.pool, self.tick_s, self.wake_s = setup, pool, tick_s, wake_s
        self.master: Master[Any] = Master(setup)
        self.cond = threading.Condition()
        self.slots: dict[int, Slot] = {}
        self.deaths: list[WorkerDeath] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dpp-master", daemon=True)

    def start(self) -> None:
        with self.cond:
            for _ in range(self.setup.workers):
                self._spawn()
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.tick_s + 2.0)
        self.pool.close()

    # ---- the loop (its own thread) ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if self._stop:
                        return
                    self._assign()
                events = self.pool.poll(self.tick_s)
                now = time.monotonic()
                with self.cond:
                    for e in events:
                        self._apply(e, now)
                    for wid in self.master.overdue(now):
                        self._lose(wid, now, f"busy on one split past dsi.split_timeout_s="
                                             f"{self.setup.limits.split_timeout_s:g} s", kill=True)
                    autoscale_step(self.master, now, list(self.slots.values()), self._spawn, self._retire)
                    if events:
                        self.cond.notify_all()
        except Exception as exc:  # noqa: BLE001 - reported to every client as one line
            with self.cond:
                self.master.fatal = self.master.fatal or f"DPP master failed: {type(exc).__name__}: {exc}"
                self.cond.notify_all()

    def _spawn(self) -> None:
        wid = self.pool.spawn()
        self.slots[wid] = Slot(wid)

    def _apply(self, e: PoolEvent, now: float) -> None:
        w = self.slots.get(e.wid)
        if w is None:  # killed or retired already: what it says no longer counts
            return
        if e.kind is EventKind.ready:
            w.ready = True
        elif e.kind is EventKind.gone:
            if w.retiring and w.task is None:
                del self.slots[e.wid]
            else:
                self._lose(e.wid, now, e.message, kill=False)
        else:
            if e.kind is EventKind.done:
                self.master.complete(e.wid, e.meta, e.payload)
            elif w.task is not None:
                self.master.failed(e.wid, w.task, e.message)
            w.task = None
            if w.retiring:
                self._retire(w)

    def _lose(self, wid: int, now: float, reason: str, kill: bool) -> None:
        """A worker died or is killed: its split is requeued, a replacement starts (unless workers keep dying)."""
        self.slots.pop(wid, None)
        if kill:
            self.pool.kill(wid)
        self.deaths.append(WorkerDeath(noticed_at=now, wid=wid, reason=reason))
        if self.master.lost(wid, reason) and not self._stop:
            self._spawn()
        self.cond.notify_all()

    def _retire(self, w: Slot) -> None:
        self.slots.pop(w.wid, None)
        self.pool.kill(w.wid)

    def _assign(self) -> None:
        now = time.monotonic()
        for w in list(self.slots.values()):
            if not w.ready or w.task is not None or w.retiring:
                continue
            task = self.master.lease(w.wid, now, len(self.slots))
            if task is None:
                self.cond.notify_all()  # clients may now see `finished` (or the fatal error)
                return
            w.task = task
            self.pool.send(w.wid, task)

    # ---- clients (their threads) ------------------------------------------------------------------------------
    def pull(self, client: int, timeout_s: float, finished: list[Finished], waited: float = 0.0
             ) -> Optional[Pulled]:
        """Report `finished` splits (and the seconds the client waited since its last pull), then the next finished
        split; None once a finite service delivered everything. Raises DataError (a bad split, a failed loop) or
        DataStall (nothing within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:  # (a re-entrant lock)
            self.report(client, finished, waited)
            m = self.master
            while True:
                got = m.take()
                if got is not None:
                    self.cond.notify_all()  # room in the buffer
                    return Pulled(got[0], got[1], m.complete_below())
                if m.finished:
                    return None
                if not self._thread.is_alive():
                    raise DataError(m.fatal or "DPP master loop is not running")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataStall(f"DPP: no batch for {timeout_s:.0f} s (dsi.stall_timeout_s); {len(self.slots)} "
                                    f"{self.pool.what}, {len(m.leases)} splits in flight")
                self.cond.wait(min(left, self.wake_s))

    def report_wait(self, client: int, seconds: float) -> None:
        with self.cond:
            self.master.report_wait(client, seconds)

    def report(self, client: int, finished: list[Finished], waited: float) -> None:
        """What `pull` reports, without taking a split."""
        with self.cond:
            self.master.finish(finished)
            self.master.report_wait(client, waited)
            if finished:
                self.cond.notify_all()  # the service may have finished: the clients' pulls end

    def reread(self, task: Task, reason: str) -> None:
        """A client could not fetch this split's rows (nothing of it was delivered): read it again."""
        with self.cond:
            self.master.reread(task, reason)
            self.cond.notify_all()

    def stats(self) -> DppStats:
        with self.cond:
            s = replace(self.master.counters)
            s.workers = sum(1 for w in self.slots.values() if not w.retiring)
            return s

    def workers_ready(self) -> int:
        """Workers started and not retiring (benchmarks wait for them: start-up is not throughput)."""
        with self.cond:
            return sum(1 for w in self.slots.values() if w.ready and not w.retiring)

    def in_flight(self) -> dict[int, Task]:
        """worker id -> the task it holds."""
        with self.cond:
            return {w: lease.task for w, lease in self.master.leases.items()}


class InProcessService:
    """The DppBackend of a ServiceLoop in this process (one service per trainer rank): clients pull from it
    directly; the pool's payloads are SplitResults."""

    def __init__(self, setup: ServiceSetup, pool: WorkerPool, tick_s: float, wake_s: float) -> None:
        self.setup = setup
        self.loop = ServiceLoop(setup, pool, tick_s, wake_s)
        self._closed = False

    @property
    def pool(self) -> WorkerPool:
        return self.loop.pool

    @property
    def master(self) -> Master[Any]:
        return self.loop.master

    def start(self) -> None:
        self.loop.start()

    def pull(self, client: int, timeout_s: float, finished: list[Finished]) -> Optional[SplitResult]:
        got = self.loop.pull(client, timeout_s, finished)
        if got is None:
            return None
        result = got.payload if got.payload is not None else SplitResult.skipped_split(got.meta)
        result.complete_below = got.complete_below
        return result

    def report_wait(self, client: int, seconds: float) -> None:
        self.loop.report_wait(client, seconds)

    def position(self, step: int, records: dict[int, Consumed]) -> Position:
        return merge_records(self.setup, records)

    def stats(self) -> DppStats:
        return self.loop.stats()

    def workers_ready(self) -> int:
        return self.loop.workers_ready()

    @property
    def in_flight(self) -> dict[int, Task]:
        return self.loop.in_flight()

    @property
    def deaths(self) -> list[WorkerDeath]:
        return self.loop.deaths

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.stop()
