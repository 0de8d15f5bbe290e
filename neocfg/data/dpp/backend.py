"""The DPP service interface (DppBackend) and what every backend shares: the split queue, the bounded buffer of
finished splits, bad-split handling and counters.

A backend owns a master (the SplitQueue, handing tasks out and taking results back) and its workers; clients call
`pull(client)` to take the next finished split. Two backends ship: `local` (worker processes, neocfg/data/dpp/local.py)
and `inline` (the split is processed in the caller, no parallelism: for eval sources and tests). A remote backend
(workers on other hosts) implements the same five methods.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

from neocfg.data.dataset import Split
from neocfg.data.dpp.progress import Position, SplitQueue, Task
from neocfg.data.dpp.worker import SplitReader, SplitResult, WorkerSpec
from neocfg.errors import DataError
from neocfg.types import DppBackendKind, OnBadSplit


@dataclass(frozen=True)
class ServiceLimits:
    # Finished splits buffered per client (the bounded queue between workers and trainers).
    prefetch_splits: int = 4
    # A worker busy longer than this on one split is killed and the split requeued.
    split_timeout_s: float = 60.0
    # A client that gets no data for this long raises instead of hanging.
    stall_timeout_s: float = 120.0
    max_workers: int = 16
    autoscale: bool = False


@dataclass(frozen=True)
class ServiceSetup:
    splits: tuple[Split, ...]
    spec: WorkerSpec
    workers: int
    seed: int
    num_clients: int = 1
    on_bad_split: OnBadSplit = OnBadSplit.fail
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    # None: epochs roll over forever (training); n: stop after n epochs (tests, benchmarks).
    max_epochs: Optional[int] = None
    start: Position = field(default_factory=Position)


@dataclass
class DppStats:
    workers: int = 0
    worker_restarts: int = 0
    workers_added: int = 0
    workers_retired: int = 0
    bytes_read: int = 0
    splits_done: int = 0
    splits_skipped: int = 0
    worker_busy_s: float = 0.0


class DppBackend(Protocol):
    def start(self) -> None: ...

    def pull(self, client: int, timeout_s: float) -> Optional[SplitResult]:
        """The next finished split for this client; None once a finite run (max_epochs) has nothing left.
        Raises DataError on a bad split (on_bad_split=fail), a dead service, or no data within timeout_s."""
        ...

    def report_wait(self, client: int, seconds: float) -> None:
        """A client waited this long for data (drives online scaling)."""
        ...

    def stats(self) -> DppStats: ...

    def close(self) -> None: ...


class ServiceCore:
    """Queue, buffer and counters; subclasses decide where the splits get processed."""

    def __init__(self, setup: ServiceSetup) -> None:
        self.setup = setup
        self.queue = SplitQueue(list(setup.splits), setup.seed, setup.max_epochs, setup.start)
        self.ready: deque[SplitResult] = deque()
        self.cond = threading.Condition()
        self.fatal: Optional[str] = None
        self.counters = DppStats()
        self.skipped_errors: list[str] = []
        self.in_flight: dict[int, Task] = {}  # worker id -> task
        self.wait_s = [0.0] * setup.num_clients

    @property
    def capacity(self) -> int:
        return self.setup.limits.prefetch_splits * self.setup.num_clients

    @property
    def finished(self) -> bool:
        return self.queue.exhausted and not self.in_flight and not self.ready

    def on_result(self, result: SplitResult) -> None:
        with self.cond:
            self.counters.bytes_read += result.bytes_read
            self.counters.splits_done += 1
            self.counters.worker_busy_s += result.seconds
            self.ready.append(result)
            self.cond.notify_all()

    def on_error(self, task: Task, message: str) -> None:
        """A split failed: stop everything (fail) or deliver it as an empty, skipped split (skip)."""
        with self.cond:
            if self.setup.on_bad_split is OnBadSplit.fail:
                self.fatal = self.fatal or message
            else:
                self.counters.splits_skipped += 1
                self.skipped_errors.append(message)
                self.ready.append(SplitResult(task=task, rows=0, pieces=[], bytes_read=0, seconds=0.0,
                                              skipped=message))
            self.cond.notify_all()

    def report_wait(self, client: int, seconds: float) -> None:
        self.wait_s[client] += seconds

    def take_ready(self) -> Optional[SplitResult]:
        """Under self.cond: raise the fatal error, or pop a finished split (None if there is none yet)."""
        if self.fatal:
            raise DataError(self.fatal)
        return self.ready.popleft() if self.ready else None


class InlineDppService(ServiceCore):
    """Splits processed synchronously in the caller's thread."""

    def __init__(self, setup: ServiceSetup) -> None:
        super().__init__(setup)
        self.reader = SplitReader(setup.spec)

    def start(self) -> None:
        self.counters.workers = 1

    def pull(self, client: int, timeout_s: float) -> Optional[SplitResult]:
        with self.cond:
            got = self.take_ready()
        while got is None:
            task = self.queue.next()
            if task is None:
                return None
            try:
                self.on_result(self.reader.process(task))
            except DataError as exc:
                self.on_error(task, str(exc))
            with self.cond:
                got = self.take_ready()
        return got

    def stats(self) -> DppStats:
        return self.counters

    def close(self) -> None:
        self.reader.close()


def make_backend(kind: DppBackendKind, setup: ServiceSetup) -> DppBackend:
    if kind is DppBackendKind.inline:
        return InlineDppService(setup)
    from neocfg.data.dpp.local import LocalDppService

    return LocalDppService(setup)
