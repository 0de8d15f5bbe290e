"""The DPP master's policy, free of processes, threads and transports (unit-testable on its own).

One Master per service: the local backend runs it in a thread of the trainer process (one service per rank), the Ray
backend in one named actor per job. Transports (neocfg/data/dpp/local.py, ray_backend.py) start workers, carry tasks
and results, and tell the master what happened; the master decides:

  split queue   epochs in a seeded order, requeued tasks first (progress.SplitQueue)
  leases        which worker holds which task since when; a task is leased only while the finished splits and the
                splits in work are fewer than the buffer (prefetch_splits per client) plus the workers; a lease past
                `split_timeout_s` is overdue (the transport kills its worker); a task whose workers died
                MAX_SPLIT_ATTEMPTS times is a bad split
  backups       a lease that runs BACKUP_FACTOR times the recent median split time (and at least BACKUP_MIN_S) is a
                straggler: the next idle worker reads the same split (MapReduce's backup tasks); the first result is
                delivered, the other dropped, and the straggler's death requeues nothing. A hung host (one whose
                death its cluster declares only after health checks, ~15-30 s on Ray) then delays no split by more
                than about a second
  progress      per split, not per sample: the open epochs' finished splits (reported by the clients with their next
                pull once every row of a split was delivered), to count duplicates and to tell clients which epochs
                are complete; memory grows with the number of splits, never with the number of samples. The
                checkpoint's Position is not the master's: the clients' own records put together (progress.py)
  emptiness     an epoch whose every split came back with no row left after the transforms fails the job at once,
                naming the filter that dropped the rows (instead of spinning on empty splits forever)
  scaling       add a worker while clients stall, retire one while they never wait and the buffer is full, within
                [min_workers, max_workers] (dsi.autoscale)

Results are generic: the local backend buffers the SplitResult itself, the Ray backend an object-store reference.
Callers serialize access (a lock, or an actor's thread).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

from neocfg.data.dataset import Split
from neocfg.data.dpp.progress import Finished, Position, SplitMeta, SplitQueue, Task
from neocfg.data.dpp.worker import WorkerSpec
from neocfg.errors import DataError
from neocfg.types import OnBadSplit

# A split whose worker died this many times is reported as a bad split (it is what kills them).
MAX_SPLIT_ATTEMPTS = 3
# Replacement workers allowed per configured worker before the service gives up (something kills every worker).
MAX_RESTARTS_PER_WORKER = 8
# Backup tasks (Dean and Ghemawat, MapReduce, OSDI'04, section 3.6: their sort took 44% longer with backup tasks
# turned off, waiting on stragglers): a lease is a straggler once it runs this many times the median
# of the last BACKUP_WINDOW splits' read times, and at least BACKUP_MIN_S. The floor keeps a service whose splits
# take milliseconds from reading splits twice on a scheduling hiccup; the cost of a backup is one split read again.
BACKUP_FACTOR = 4.0
BACKUP_MIN_S = 1.0
BACKUP_WINDOW = 32
# Online scaling (DSI, ISCA'22 section 5: the DPP master scales workers to keep trainers from stalling): decide once
# per period; add a worker when clients waited more than this fraction of it ...
AUTOSCALE_PERIOD_S = 1.0
AUTOSCALE_STALL_FRACTION = 0.05
# ... and retire one when they waited less than this fraction while the buffer was full.
AUTOSCALE_IDLE_FRACTION = 0.001
# A stall measured above this counts as this when sizing an addition (at most 1 / (1 - 0.75) = 4x the workers in one
# step: a period that includes start-up waits can read close to 1).
AUTOSCALE_MAX_STALL = 0.75


@dataclass(frozen=True)
class ServiceLimits:
    # Finished splits buffered per client (the bounded queue between workers and trainers).
    prefetch_splits: int = 4
    # A worker busy longer than this on one split is killed and the split requeued.
    split_timeout_s: float = 60.0
    # A client that gets no sample for this long raises instead of hanging.
    stall_timeout_s: float = 120.0
    max_workers: int = 16
    autoscale: bool = False
    # Autoscaling never retires below this many workers.
    min_workers: int = 1


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
    # Said in the "no sample left" error: whose splits these are ("this rank's 3 splits", "the job's 12 splits").
    scope: str = "the service's"


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
    # Rows of a split reported finished twice (by two clients, or twice by one): 0 when delivery is exactly-once.
    duplicate_rows: int = 0
    # Splits read again because their finished rows were lost before a client fetched them (a lost node).
    splits_reread: int = 0
    # Ids the declared truncate transforms cut from bags (dsi.transforms ... op: truncate).
    ids_cut: int = 0
    # Splits read a second time because their first lease straggled (backup tasks), and of those the results that
    # came second and were dropped.
    backups: int = 0
    backups_dropped: int = 0


class DataStall(DataError):
    """No finished split came within the client's timeout (the client words it: it knows its stall clock)."""


@dataclass
class Lease:
    task: Task
    since: float


def task_key(task: Task) -> tuple[int, int]:
    return task.epoch, task.split.index


class Scale(Enum):
    keep = "keep"
    add = "add"
    retire = "retire"


P = TypeVar("P")


class WorkerSlot(Protocol):
    """What a transport's worker record shows the scaling step."""

    task: Optional[Task]
    ready: bool
    retiring: bool


def autoscale_step(master: "Master", now: float, workers: list[Any], spawn: Callable[[], None],
                   retire: Callable[[Any], None]) -> None:
    """Ask the master for a scaling decision and carry it out with the transport's spawn/retire: a retired worker
    is an idle one, or the last one once it finished its split."""
    active = [w for w in workers if not w.retiring]
    decision, count = master.scale(now, len(active), any(not w.ready for w in active))
    if decision is Scale.add:
        for _ in range(count):
            spawn()
    elif decision is Scale.retire:
        victim = next((w for w in active if w.task is None), active[-1])
        victim.retiring = True
        if victim.task is None:
            retire(victim)


class Master(Generic[P]):
    def __init__(self, setup: ServiceSetup) -> None:
        self.setup = setup
        start = setup.start
        self.queue = SplitQueue(list(setup.splits), setup.seed, setup.max_epochs, start)
        self.ready: deque[tuple[SplitMeta, Optional[P]]] = deque()  # payload None: a skipped split
        self.leases: dict[int, Lease] = {}
        self.attempts: dict[tuple[int, int], int] = {}
        # Backups: tasks two leases hold; tasks whose result was taken while another lease on them still runs (its
        # result is dropped, its death requeues nothing); recent split read times, for telling a straggler.
        self._backed: set[tuple[int, int]] = set()
        self.served: set[tuple[int, int]] = set()
        self._recent_s: deque[float] = deque(maxlen=BACKUP_WINDOW)
        self.counters = DppStats()
        self.fatal: Optional[str] = None
        self.skipped_errors: list[str] = []
        self.wait_s = [0.0] * setup.num_clients
        # Per-split progress: the newest epoch handed out and, per epoch not yet complete, its finished splits.
        self.last_epoch = start.last_epoch
        self.open: dict[int, set[int]] = {e: set(d) for e, d in start.done.items()}
        # Empty-epoch detection, for epochs started from scratch: whole-split results in, rows left, drops per filter.
        self._fresh: dict[int, list[int]] = {}  # epoch -> [results, rows left, rows read]
        self._dropped: dict[int, Counter] = {}
        self._resumed_epochs = set(start.done) | {e for e, *_ in start.pending}
        # Autoscaling: the clients' total wait at the last decision.
        self._last_scale: Optional[float] = None
        self._scale_wait = 0.0

    # ---- buffer -----------------------------------------------------------------------------------------------
    @property
    def num_splits(self) -> int:
        return len(self.setup.splits)

    @property
    def capacity(self) -> int:
        return self.setup.limits.prefetch_splits * self.setup.num_clients

    @property
    def finished(self) -> bool:
        """A finite service (max_epochs) handed out and delivered everything (a straggler whose backup was
        delivered is not waited for)."""
        return (self.queue.exhausted and not self.ready
                and all(task_key(lease.task) in self.served for lease in self.leases.values()))

    def room(self, workers: int) -> bool:
        """Every worker may hold a split on top of a full buffer: counting the splits in work against the buffer
        leaves workers idle whenever a split waits for its client (4 workers and a buffer of 4 split as 1 waiting
        and 3 in work)."""
        return len(self.ready) + len(self.leases) < self.capacity + workers

    # ---- workers ----------------------------------------------------------------------------------------------
    def lease(self, worker: int, now: float, workers: int = 1) -> Optional[Task]:
        """The next task for an idle worker; None when the buffer is full or nothing is left."""
        if self.fatal:
            return None
        backup = self._straggler(worker, now)
        if backup is not None:  # (outside the buffer's room: the straggler's slot already counts)
            self.counters.backups += 1
            self._backed.add(task_key(backup))
            self.leases[worker] = Lease(backup, now)
            return backup
        if not self.room(workers):
            return None
        task = self.queue.next()
        if task is None:
            return None
        for e in range(self.last_epoch + 1, task.epoch + 1):
            self.open.setdefault(e, set())
        self.last_epoch = max(self.last_epoch, task.epoch)
        self.leases[worker] = Lease(task, now)
        return task

    def _straggler(self, worker: int, now: float) -> Optional[Task]:
        """The task of the oldest lease past the backup threshold that has no backup yet (None if there is none,
        or no split finished yet to judge by). Leases are kept in the order they were made, oldest first, so the
        common case (the oldest lease is young) costs one look."""
        oldest = next(iter(self.leases.values()), None)
        if oldest is None or now - oldest.since <= BACKUP_MIN_S or not self._recent_s:
            return None
        limit = max(BACKUP_MIN_S, BACKUP_FACTOR * sorted(self._recent_s)[len(self._recent_s) // 2])
        for w, lease in self.leases.items():
            if now - lease.since <= limit:
                return None
            key = task_key(lease.task)
            if w != worker and key not in self._backed and key not in self.served:
                return lease.task
        return None

    def _settle(self, worker: int, task: Task) -> tuple[bool, bool]:
        """Drop `worker`'s lease on `task`: (its outcome still counts, i.e. no twin lease's result was taken for
        it; a twin lease on it still runs). A taken task is forgotten once no lease on it is left."""
        self.leases.pop(worker, None)
        key = task_key(task)
        twin = key in self._backed
        self._backed.discard(key)
        if key in self.served:
            if not twin:
                self.served.discard(key)
            return False, twin
        return True, twin

    def complete(self, worker: int, meta: SplitMeta, payload: P) -> None:
        c = self.counters
        c.bytes_read += meta.bytes_read
        c.worker_busy_s += meta.seconds
        self._recent_s.append(meta.seconds)
        counts, twin = self._settle(worker, meta.task)
        if not counts:  # its backup's twin delivered it first
            c.backups_dropped += 1
            return
        if twin:
            self.served.add(task_key(meta.task))
        c.ids_cut += meta.ids_cut
        c.splits_done += 1
        self.ready.append((meta, payload))
        self._check_empty(meta)

    def failed(self, worker: int, task: Task, message: str) -> None:
        """A split failed on a worker: stop everything (fail) or deliver it as an empty, skipped split (skip)."""
        counts, twin = self._settle(worker, task)
        if not counts:
            return
        if twin:
            self.served.add(task_key(task))
        self._bad(task, message)

    def _bad(self, task: Task, message: str) -> None:
        if self.setup.on_bad_split is OnBadSplit.fail:
            self.fatal = self.fatal or message
            return
        self.counters.splits_skipped += 1
        self.skipped_errors.append(message)
        meta = SplitMeta(task=task, rows=0, delivered_rows=0, bytes_read=0, seconds=0.0, skipped=message)
        self.ready.append((meta, None))
        self._check_empty(meta)

    def lost(self, worker: int, reason: str) -> bool:
        """A worker died (or was killed as overdue): requeue its task; False when workers keep dying (give up)."""
        lease = self.leases.get(worker)
        if lease is not None and self._settle(worker, lease.task) != (True, False):
            lease = None  # delivered by its backup's twin, or the twin still reads it
        if lease is not None:
            key = task_key(lease.task)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            if self.attempts[key] >= MAX_SPLIT_ATTEMPTS:
                self._bad(lease.task, f"{lease.task.split.where}: killed {MAX_SPLIT_ATTEMPTS} workers (last: {reason})")
            else:
                self.queue.requeue(lease.task)
        self.counters.worker_restarts += 1
        if self.counters.worker_restarts > MAX_RESTARTS_PER_WORKER * max(self.setup.workers, 1):
            self.fatal = self.fatal or (f"DPP: workers keep dying ({self.counters.worker_restarts} restarts; "
                                        f"last: {reason})")
            return False
        return True

    def reread(self, task: Task, reason: str) -> None:
        """A split's result was lost after its worker finished (its rows' node or object store is gone, or they
        could not be fetched in time) and nothing of it was delivered: queue it again to be read from storage, or
        take the result of a twin lease still reading it."""
        key = task_key(task)
        self.counters.splits_reread += 1
        if key in self.served:  # the straggler still reads it: its result counts now
            self.served.discard(key)
            return
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] >= MAX_SPLIT_ATTEMPTS:
            self._bad(task, f"{task.split.where}: its rows were lost {MAX_SPLIT_ATTEMPTS} times (last: {reason})")
        else:
            self.queue.requeue(task)

    def overdue(self, now: float) -> list[int]:
        """Workers busy on one split for longer than split_timeout_s (the transport kills them)."""
        limit = self.setup.limits.split_timeout_s
        return [w for w, lease in self.leases.items() if now - lease.since > limit]

    # ---- clients ----------------------------------------------------------------------------------------------
    def take(self) -> Optional[tuple[SplitMeta, Optional[P]]]:
        """Raise the fatal error, or pop a finished split (None if there is none yet)."""
        if self.fatal:
            raise DataError(self.fatal)
        return self.ready.popleft() if self.ready else None

    def report_wait(self, client: int, seconds: float) -> None:
        self.wait_s[client] += seconds

    def finish(self, done: list[Finished]) -> None:
        """Clients delivered every owed row of these splits."""
        for f in done:
            if f.epoch not in self.open:
                if f.epoch <= self.last_epoch:  # the epoch is complete already: this split came twice
                    self.counters.duplicate_rows += f.rows
                continue
            got = self.open[f.epoch]
            if f.split in got:
                self.counters.duplicate_rows += f.rows
                continue
            got.add(f.split)
            if len(got) == self.num_splits:
                del self.open[f.epoch]
                self._fresh.pop(f.epoch, None)
                self._dropped.pop(f.epoch, None)

    def complete_below(self) -> int:
        """Epochs below this are complete: every split of them was delivered whole by some client."""
        return min(self.open) if self.open else self.last_epoch + 1

    def tracking_size(self) -> int:
        """Entries the progress tracking holds (split ids and counters): bounded by splits, not samples."""
        return sum(len(d) for d in self.open.values()) + len(self.open) + len(self._fresh) + len(self.attempts)

    # ---- emptiness --------------------------------------------------------------------------------------------
    def _check_empty(self, meta: SplitMeta) -> None:
        e = meta.task.epoch
        if meta.task.keep is not None or e in self._resumed_epochs:
            return
        acc = self._fresh.setdefault(e, [0, 0, 0, 0])  # results, rows left, rows read, skipped
        acc[0] += 1
        acc[1] += meta.rows
        acc[2] += meta.rows_read
        acc[3] += meta.skipped is not None
        drops = self._dropped.setdefault(e, Counter())
        for i, what, n in meta.dropped:
            drops[(i, what)] += n
        if acc[0] == self.num_splits and acc[1] == 0 and self.setup.max_epochs is None:
            if acc[3] == acc[0]:
                self.fatal = self.fatal or (f"DPP: every one of {self.setup.scope} {self.num_splits} splits is bad "
                                            f"and was skipped (dsi.on_bad_split=skip); last: {meta.skipped}")
            else:
                self.fatal = self.fatal or self._empty_message(acc[2], drops)

    def _empty_message(self, rows_read: int, drops: Counter) -> str:
        head = (f"DPP: no sample left after the transforms in {self.setup.scope} {self.num_splits} splits "
                f"({rows_read:,} rows read in a whole epoch)")
        if not drops:
            return head + "; the splits are empty"
        (i, what), n = drops.most_common(1)[0]
        return f"{head}: dsi.transforms.{i} ({what}) dropped {n:,} of them; relax that filter or check the data"

    # ---- scaling ----------------------------------------------------------------------------------------------
    def scale(self, now: float, active: int, starting: bool) -> tuple[Scale, int]:
        """Once per AUTOSCALE_PERIOD_S: add workers while clients stall, retire one while nobody waits and the buffer
        is full. `active`: workers not retiring; `starting`: one of them is not ready yet (judge once it helps).

        Workers added: clients that waited a fraction s of the period got (1 - s) of what they wanted, so the
        workers needed are about active / (1 - s); that many (at least one) are added at once, up to max_workers,
        so that slow worker start-up does not make scaling take one start-up per worker."""
        limits = self.setup.limits
        if not limits.autoscale:
            return Scale.keep, 0
        if self._last_scale is None:
            self._last_scale, self._scale_wait = now, sum(self.wait_s)
            return Scale.keep, 0
        if now - self._last_scale < AUTOSCALE_PERIOD_S:
            return Scale.keep, 0
        waited = sum(self.wait_s) - self._scale_wait
        stall = min(waited / ((now - self._last_scale) * self.setup.num_clients), AUTOSCALE_MAX_STALL)
        self._last_scale, self._scale_wait = now, sum(self.wait_s)
        if starting:
            return Scale.keep, 0
        if stall > AUTOSCALE_STALL_FRACTION and active < limits.max_workers and not self.queue.exhausted:
            add = max(1, math.ceil(active / (1.0 - stall)) - active)
            add = min(add, limits.max_workers - active)
            self.counters.workers_added += add
            return Scale.add, add
        if stall < AUTOSCALE_IDLE_FRACTION and len(self.ready) >= self.capacity and active > limits.min_workers:
            self.counters.workers_retired += 1
            return Scale.retire, 1
        return Scale.keep, 0
