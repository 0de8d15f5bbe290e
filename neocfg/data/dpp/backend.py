"""The DPP service interface (DppBackend) and the inline backend.

A backend runs a Master (neocfg/data/dpp/master.py: the policy) somewhere: the backends with workers run the one
worker loop (neocfg/data/dpp/loop.py) over their transport's pool of workers, which starts workers, carries tasks to
them and finished splits back. Clients call `pull(client, ...)` for the next
finished split and report the splits they delivered whole; nothing else crosses to the master per batch. At a
checkpoint, `position` puts the clients' records (progress.Consumed) together. Backends: `inline` (here: the split
is processed in the caller, no parallelism: eval sources and tests), `local` (worker processes,
neocfg/data/dpp/local.py), `ray` (a named master actor per job, worker actors, neocfg/data/dpp/ray_backend.py), each
declared by a module of neocfg/data/dpp/backends/; make_backend is in service.py.
"""

from __future__ import annotations

import time
from typing import Optional, Protocol

from neocfg.data.dpp.master import DppStats, Master, ServiceSetup
from neocfg.data.dpp.progress import Consumed, Finished, Position
from neocfg.data.dpp.worker import SplitReader, SplitResult
from neocfg.errors import DataError


class DppBackend(Protocol):
    def start(self) -> None: ...

    def pull(self, client: int, timeout_s: float, finished: list[Finished]) -> Optional[SplitResult]:
        """Report `finished` splits, then the next finished split for this client; None once a finite run
        (max_epochs) has nothing left. Raises DataError on a bad split (on_bad_split=fail), a dead service, an
        epoch with no sample left, or no result within timeout_s."""
        ...

    def report_wait(self, client: int, seconds: float) -> None:
        """A client waited this long for data (drives online scaling)."""
        ...

    def position(self, step: int, records: dict[int, Consumed]) -> Position:
        """The job's position after `step` batches per client, from these clients' records (a backend shared by
        clients in several processes waits until every client reported the same step)."""
        ...

    def stats(self) -> DppStats: ...

    def close(self) -> None: ...


def result_of(meta_payload, master: Master) -> SplitResult:
    """A buffered (meta, payload) as the SplitResult a client takes (a skipped split has no payload), with the
    master's complete epochs."""
    meta, payload = meta_payload
    result = payload if payload is not None else SplitResult.skipped_split(meta)
    result.complete_below = master.complete_below()
    return result


class InlineDppService:
    """Splits processed synchronously in the caller's thread."""

    def __init__(self, setup: ServiceSetup) -> None:
        self.setup = setup
        self.master: Master[SplitResult] = Master(setup)
        self.reader = SplitReader(setup.spec)

    def start(self) -> None:
        self.master.counters.workers = 1

    def pull(self, client: int, timeout_s: float, finished: list[Finished]) -> Optional[SplitResult]:
        m = self.master
        m.finish(finished)
        while True:
            got = m.take()
            if got is not None:
                return result_of(got, m)
            task = m.lease(0, time.monotonic())
            if task is None:
                return None
            try:
                result = self.reader.process(task)
            except DataError as exc:
                m.failed(0, task, str(exc))
            else:
                m.complete(0, result.meta(), result)

    def report_wait(self, client: int, seconds: float) -> None:
        self.master.report_wait(client, seconds)

    def position(self, step: int, records: dict[int, Consumed]) -> Position:
        return merge_records(self.setup, records)

    def stats(self) -> DppStats:
        return self.master.counters

    def close(self) -> None:
        self.reader.close()


def merge_records(setup: ServiceSetup, records: dict[int, Consumed]) -> Position:
    """The clients' records, in client order, as one Position (no master involved)."""
    return Position.merge([records[c] for c in sorted(records)], len(setup.splits))
