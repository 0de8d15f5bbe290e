"""The local DPP backend: worker processes on this host and a master thread in the process that owns the service.

The master waits on every worker's pipe and process sentinel at once, so a worker that exits or is killed is noticed
in milliseconds: the split it was on goes back to the front of the queue (its result was never sent whole, so nothing
of it was delivered) and a replacement worker starts. A worker busy past `split_timeout_s` is killed the same way; a
split that has killed MAX_SPLIT_ATTEMPTS workers is a bad split. Workers exit by themselves when the master's process
is gone (their pipe closes; they also poll their parent pid), so nothing is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Optional

from neocfg.data.dpp.backend import merge_records, result_of
from neocfg.data.dpp.master import DataStall, DppStats, Master, ServiceSetup, autoscale_step
from neocfg.data.dpp.progress import Consumed, Finished, Position, Task
from neocfg.data.dpp.worker import Msg, SplitResult, worker_main
from neocfg.errors import DataError

# Spawned, not forked: the owner is a trainer with torch and threads, which fork does not copy safely.
_CONTEXT = mp.get_context("spawn")
# The master wakes at least this often (seconds) to check timeouts, scaling and shutdown.
TICK_S = 0.1
# How long to wait for workers to exit on close before killing them (seconds).
CLOSE_GRACE_S = 2.0


@dataclass
class _Worker:
    wid: int
    proc: mp.Process
    conn: Connection
    ready: bool = False
    retiring: bool = False
    task: Optional[Task] = None
    since: float = 0.0


@dataclass(frozen=True)
class WorkerDeath:
    """A worker the master found dead: when (time.monotonic()), which process, why."""

    noticed_at: float
    pid: int
    reason: str


def _exit_reason(w: _Worker) -> str:
    """Its pipe or sentinel closes as the process exits, a moment before it can be reaped."""
    w.proc.join(timeout=0.5)
    code = w.proc.exitcode
    return "pipe closed" if code is None else f"exit code {code}"


class LocalDppService:
    """Worker processes and the master thread; `self.cond` guards the Master and is what clients wait on."""

    def __init__(self, setup: ServiceSetup) -> None:
        self.setup = setup
        self.master: Master[SplitResult] = Master(setup)
        self.cond = threading.Condition()
        self.workers: dict[int, _Worker] = {}
        self.deaths: list[WorkerDeath] = []
        self._next_wid = 0
        self._stop = threading.Event()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="dpp-master", daemon=True)

    @property
    def in_flight(self) -> dict[int, Task]:
        """worker id -> the task it holds."""
        with self.cond:
            return {w: lease.task for w, lease in self.master.leases.items()}

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        for _ in range(self.setup.workers):
            self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        parent, child = _CONTEXT.Pipe(duplex=True)
        wid = self._next_wid
        self._next_wid += 1
        proc = _CONTEXT.Process(target=worker_main, args=(child, self.setup.spec, wid, os.getpid()),
                                name=f"dpp-worker-{wid}", daemon=True)
        proc.start()
        child.close()  # only the worker holds its end: its death closes the pipe
        self.workers[wid] = _Worker(wid=wid, proc=proc, conn=parent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_GRACE_S + 1)
        for w in self.workers.values():
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for w in self.workers.values():
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=1.0)
            w.conn.close()
        self.workers.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def workers_ready(self) -> int:
        """Workers started and not retiring (benchmarks wait for them: start-up is not throughput)."""
        return sum(1 for w in list(self.workers.values()) if w.ready and not w.retiring)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers.values() if w.proc.pid is not None]

    # ---- client side -----------------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def pull(self, client: int, timeout_s: float, finished: list[Finished]) -> Optional[SplitResult]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.master.finish(finished)
            while True:
                got = self.master.take()
                if got is not None:
                    self._wake()  # room in the buffer: the master may hand out another split
                    return result_of(got, self.master)
                if self.master.finished:
                    return None
                if not self._thread.is_alive():
                    raise DataError(self.master.fatal or "DPP master thread is not running")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataStall(f"DPP: no batch for {timeout_s:.0f} s (dsi.stall_timeout_s); "
                                    f"{len(self.workers)} workers, {len(self.master.leases)} splits in flight")
                self.cond.wait(min(left, TICK_S))

    def report_wait(self, client: int, seconds: float) -> None:
        with self.cond:
            self.master.report_wait(client, seconds)

    def position(self, step: int, records: dict[int, Consumed]) -> Position:
        return merge_records(self.setup, records)

    def stats(self) -> DppStats:
        with self.cond:
            s = DppStats(**vars(self.master.counters))
            s.workers = sum(1 for w in self.workers.values() if not w.retiring)
            return s

    # ---- master ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception as exc:  # noqa: BLE001 - reported to every client as one line
            with self.cond:
                self.master.fatal = self.master.fatal or f"DPP master failed: {type(exc).__name__}: {exc}"
                self.cond.notify_all()

    def _step(self) -> None:
        by_conn = {w.conn: w for w in self.workers.values()}
        by_sentinel = {w.proc.sentinel: w for w in self.workers.values()}
        ready = wait([*by_conn, *by_sentinel, self._wake_r], timeout=TICK_S)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        for obj in ready:
            w = by_conn.get(obj)  # type: ignore[call-overload]
            if w is not None and w.wid in self.workers:
                self._receive(w)
        for obj in ready:
            w = by_sentinel.get(obj)  # type: ignore[call-overload]
            if w is not None and w.wid in self.workers:
                self._drain(w)
                self._gone(w, _exit_reason(w))
        self._kill_overdue()
        self._autoscale()
        self._assign()

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._gone(w, _exit_reason(w))
            return
        kind = msg[0]
        if kind is Msg.ready:
            w.ready = True
            return
        w.task = None
        with self.cond:  # one step, so that no client sees the split neither in flight nor finished
            if kind is Msg.result:
                self.master.complete(w.wid, msg[1].meta(), msg[1])
            else:
                self.master.failed(w.wid, msg[1], msg[2])
            self.cond.notify_all()
        if w.retiring:
            self._retire_now(w)

    def _drain(self, w: _Worker) -> None:
        """Results a worker sent before it exited still count."""
        try:
            while w.wid in self.workers and w.conn.poll(0):
                self._receive(w)
        except (EOFError, OSError):
            pass

    def _gone(self, w: _Worker, reason: str) -> None:
        if w.wid not in self.workers:
            return
        del self.workers[w.wid]
        w.conn.close()
        if w.retiring and w.task is None:
            return
        self.deaths.append(WorkerDeath(noticed_at=time.monotonic(), pid=w.proc.pid or -1, reason=reason))
        with self.cond:
            replace = self.master.lost(w.wid, reason)
            self.cond.notify_all()
        if replace and not self._stop.is_set():
            self._spawn()

    def _kill_overdue(self) -> None:
        with self.cond:
            late = self.master.overdue(time.monotonic())
        for wid in late:
            if wid in self.workers:
                self.workers[wid].proc.kill()  # its sentinel fires next step; the split is requeued there

    def _assign(self) -> None:
        idle = [w for w in self.workers.values() if w.ready and w.task is None and not w.retiring]
        for w in idle:
            with self.cond:
                task = self.master.lease(w.wid, time.monotonic(), len(self.workers))
                if task is None:
                    self.cond.notify_all()  # clients may now see `finished` (or the fatal error)
                    return
            w.task, w.since = task, time.monotonic()
            try:
                w.conn.send(task)
            except (OSError, ValueError):
                pass  # dead; its sentinel fires next step and requeues the task

    def _autoscale(self) -> None:
        with self.cond:
            autoscale_step(self.master, time.monotonic(), list(self.workers.values()), self._spawn, self._retire_now)

    def _retire_now(self, w: _Worker) -> None:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
