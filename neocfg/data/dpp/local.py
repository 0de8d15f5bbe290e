"""The local DPP backend: worker processes on this host, under the worker loop (loop.py) in the process that owns
the service (one service per trainer rank).

The pool waits on every worker's pipe and process sentinel at once, so a worker that exits or is killed is noticed
in milliseconds: the loop puts the split it was on back at the front of the queue (its result was never sent whole,
so nothing of it was delivered) and starts a replacement. Workers exit by themselves when the owner's process is gone
(their pipe closes; they also poll their parent pid), so nothing is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from neocfg.data.dpp.loop import EventKind, InProcessService, PoolEvent
from neocfg.data.dpp.master import ServiceSetup
from neocfg.data.dpp.progress import Task
from neocfg.data.dpp.worker import Msg, WorkerSpec, worker_main

# Spawned, not forked: the owner is a trainer with torch and threads, which fork does not copy safely.
_CONTEXT = mp.get_context("spawn")
# The loop wakes at least this often (seconds) to check timeouts, scaling and shutdown; a blocked client too.
TICK_S = 0.1
# How long to wait for workers to exit on close before killing them (seconds).
CLOSE_GRACE_S = 2.0


@dataclass
class _Process:
    proc: mp.Process
    conn: Connection


def _exit_reason(p: _Process) -> str:
    """Its pipe or sentinel closes as the process exits, a moment before it can be reaped."""
    p.proc.join(timeout=0.5)
    code = p.proc.exitcode
    return "pipe closed" if code is None else f"exit code {code}"


class ProcessPool:
    """Worker processes (worker.worker_main), each with its own duplex pipe."""

    what = "worker processes"

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.procs: dict[int, _Process] = {}
        self._killed: list[mp.Process] = []
        self._next_wid = 0

    def spawn(self) -> int:
        parent, child = _CONTEXT.Pipe(duplex=True)
        wid = self._next_wid
        self._next_wid += 1
        proc = _CONTEXT.Process(target=worker_main, args=(child, self.spec, wid, os.getpid()),
                                name=f"dpp-worker-{wid}", daemon=True)
        proc.start()
        child.close()  # only the worker holds its end: its death closes the pipe
        self.procs[wid] = _Process(proc=proc, conn=parent)
        return wid

    def send(self, wid: int, task: Task) -> None:
        try:
            self.procs[wid].conn.send(task)
        except (OSError, ValueError):
            pass  # dead: its sentinel fires at the next poll

    def poll(self, timeout_s: float) -> list[PoolEvent]:
        by_conn = {p.conn: wid for wid, p in self.procs.items()}
        by_sentinel = {p.proc.sentinel: wid for wid, p in self.procs.items()}
        ready = wait([*by_conn, *by_sentinel], timeout=timeout_s)
        events: list[PoolEvent] = []
        for obj in ready:
            if obj in by_conn and by_conn[obj] in self.procs:
                events += self._receive(by_conn[obj])
        for obj in ready:
            if obj in by_sentinel and by_sentinel[obj] in self.procs:
                wid = by_sentinel[obj]
                while wid in self.procs and self.procs[wid].conn.poll(0):  # results sent before it exited count
                    events += self._receive(wid)
                if wid in self.procs:
                    events.append(self._gone(wid, _exit_reason(self.procs[wid])))
        self._killed = [p for p in self._killed if p.exitcode is None]  # reaps the killed ones
        return events

    def _receive(self, wid: int) -> list[PoolEvent]:
        try:
            msg = self.procs[wid].conn.recv()
        except (EOFError, OSError):
            return [self._gone(wid, _exit_reason(self.procs[wid]))]
        if msg[0] is Msg.ready:
            return [PoolEvent(EventKind.ready, wid)]
        if msg[0] is Msg.result:
            return [PoolEvent(EventKind.done, wid, meta=msg[1].meta(), payload=msg[1])]
        return [PoolEvent(EventKind.failed, wid, message=msg[2])]

    def _gone(self, wid: int, reason: str) -> PoolEvent:
        self.procs.pop(wid).conn.close()
        return PoolEvent(EventKind.gone, wid, message=reason)

    def kill(self, wid: int) -> None:
        p = self.procs.pop(wid, None)
        if p is not None:
            p.proc.kill()
            p.conn.close()
            self._killed.append(p.proc)

    def pid(self, wid: int) -> int:
        return self.procs[wid].proc.pid or -1

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs.values() if p.proc.pid is not None]

    def close(self) -> None:
        for p in self.procs.values():
            try:
                p.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in [p.proc for p in self.procs.values()] + self._killed:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        for p in self.procs.values():
            p.conn.close()
        self.procs.clear()
        self._killed.clear()


class LocalDppService(InProcessService):
    """Worker processes under this process's worker loop."""

    def __init__(self, setup: ServiceSetup) -> None:
        super().__init__(setup, ProcessPool(setup.spec), tick_s=TICK_S, wake_s=TICK_S)

    def worker_pids(self) -> list[int]:
        return self.pool.pids()  # type: ignore[attr-defined]
