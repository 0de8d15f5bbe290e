"""Progress bookkeeping of the DPP service, free of processes and threads (unit-testable on its own).

Position   how far the trainers got: for each epoch not yet complete, the splits whose rows were all delivered, and
           the row ranges received but still owed. Rows of a split are numbered in their order after the transforms,
           which is deterministic, so a range names the same samples on every re-read.
SplitQueue the master's queue of tasks (epoch, split, ranges to deliver): epochs in a seeded shuffled split order,
           an epoch's tasks queued only once the previous epoch's are all handed out, requeued tasks first.
SplitMeta  what the master learns of a finished split; Finished: a client delivered every owed row of a split.
Tracker    a client's per-split progress (rows owed, intervals delivered), reported to the master split by split, and
           its record of what it consumed: per epoch not known complete, the splits it delivered whole.
ClientMark the record at one batch, taken locally and cheaply before every batch (no message to the master);
Consumed   a mark made whole (the split ids themselves) at a checkpoint; Position.merge puts the clients' Consumed
           together into the job's Position, at checkpoint steps only.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from neocfg.data.dataset import Split
from neocfg.fileio import read_json, write_text_atomic

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Task:
    epoch: int
    split: Split
    # Row ranges to deliver (after transforms); None means every row of the split.
    keep: Optional[Ranges] = None


@dataclass(frozen=True)
class SplitMeta:
    """What the master needs of a finished split (the rows themselves travel separately)."""

    task: Task
    rows: int                  # rows left after the transforms
    delivered_rows: int        # of those, the rows this task delivers (its `keep` ranges)
    bytes_read: int
    seconds: float
    rows_read: int = 0         # rows before the transforms
    # Rows each filter dropped: ((transform index, description, rows), ...).
    dropped: tuple[tuple[int, str, int], ...] = ()
    skipped: Optional[str] = None
    ids_cut: int = 0           # ids the truncate transforms removed


@dataclass(frozen=True)
class Finished:
    """A client delivered every owed row of a split."""

    epoch: int
    split: int
    rows: int


# (epoch, split, start row, stop row): a range of a split's rows (numbered after the transforms).
RowRange = tuple[int, int, int, int]


@dataclass
class Position:
    """Where delivery stands.

    last_epoch  the newest epoch anything was received from (-1: none)
    done        per unfinished epoch, the splits whose rows were all delivered
    pending     the row ranges received but not delivered, in the order the client would have handed them out; a
                resumed client hands them out first and in that order, so with one worker per service a resumed run
                sees exactly the batches of an uninterrupted one
    """

    last_epoch: int = -1
    done: dict[int, set[int]] = field(default_factory=dict)
    pending: list[RowRange] = field(default_factory=list)

    def partial(self) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(epoch, split) -> its owed (start, stop) ranges, in order of first appearance in `pending`."""
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for e, s, a, b in self.pending:
            out.setdefault((e, s), []).append((a, b))
        return out

    def to_state(self) -> dict[str, Any]:
        """JSON- and torch.save-friendly."""
        return {"last_epoch": self.last_epoch,
                "done": [{"epoch": e, "splits": sorted(d)} for e, d in sorted(self.done.items())],
                "pending": [list(r) for r in self.pending]}

    @staticmethod
    def from_state(state: dict[str, Any]) -> "Position":
        return Position(last_epoch=int(state["last_epoch"]),
                        done={int(d["epoch"]): {int(s) for s in d["splits"]} for d in state["done"]},
                        pending=[(int(e), int(s), int(a), int(b)) for e, s, a, b in state["pending"]])

    def save(self, path: Path) -> None:
        """Write atomically: a crash leaves the previous checkpoint or this one, never half of one."""
        write_text_atomic(path, json.dumps(self.to_state()) + "\n")

    @staticmethod
    def load(path: Path) -> "Position":
        return read_json(path, Position.from_state, "no DPP checkpoint here", "not a DPP checkpoint")

    @staticmethod
    def merge(records: list["Consumed"], num_splits: int) -> "Position":
        """The position of several clients of one service (each split went to exactly one of them), in client
        order: epochs below the newest `complete_below` any client learned are complete, and so is an epoch whose
        every split some client delivered whole."""
        below = max([r.complete_below for r in records], default=0)
        out = Position(last_epoch=max([r.position.last_epoch for r in records], default=-1))
        for r in records:
            for e, d in r.position.done.items():
                if e >= below:
                    out.done.setdefault(e, set()).update(d)
            out.pending += r.position.pending
        # Each client lists every epoch from its complete_below to its newest; an epoch absent everywhere is complete.
        for e in [e for e, d in out.done.items() if len(d) == num_splits]:
            del out.done[e]
        return out


@dataclass(frozen=True)
class ClientMark:
    """A client's record at one batch, cheap to take: how many splits it had finished per epoch (the split ids stay
    in the Tracker, append-only until pruned), the ranges it owed, and the epochs known complete."""

    batches: int
    complete_below: int
    last_epoch: int
    finished: tuple[tuple[int, int], ...]   # (epoch, splits finished so far)
    owed: tuple[RowRange, ...]


@dataclass(frozen=True)
class Consumed:
    """What one client consumed up to a mark: its Position (only its own splits) and the epochs known complete."""

    position: Position
    complete_below: int = 0


def epoch_order(num_splits: int, epoch: int, seed: int) -> list[int]:
    """The split order of an epoch: a permutation seeded by (seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_splits)]


class SplitQueue:
    """Tasks in order; `max_epochs=None` rolls over epochs forever."""

    def __init__(self, splits: list[Split], seed: int, max_epochs: Optional[int], start: Position) -> None:
        self.splits, self.seed, self.max_epochs = splits, seed, max_epochs
        self.todo: deque[Task] = deque()
        partial = start.partial()
        for (e, s), ranges in partial.items():  # what the client held first, in its order
            self.todo.append(Task(epoch=e, split=splits[s], keep=tuple(ranges)))
        for e in sorted(start.done):
            self._queue_epoch(e, start.done[e] | {s for pe, s in partial if pe == e})
        self.next_epoch = start.last_epoch + 1

    def _queue_epoch(self, epoch: int, skip: set[int]) -> None:
        for i in epoch_order(len(self.splits), epoch, self.seed):
            if i not in skip:
                self.todo.append(Task(epoch=epoch, split=self.splits[i]))

    def next(self) -> Optional[Task]:
        if not self.todo and (self.max_epochs is None or self.next_epoch < self.max_epochs):
            self._queue_epoch(self.next_epoch, set())
            self.next_epoch += 1
        return self.todo.popleft() if self.todo else None

    def requeue(self, task: Task) -> None:
        self.todo.appendleft(task)

    @property
    def exhausted(self) -> bool:
        return not self.todo and self.max_epochs is not None and self.next_epoch >= self.max_epochs


class Tracker:
    """One client's per-split progress: for each split in hand, the rows still owed and the row intervals already
    delivered (a range delivered twice is counted in `duplicates`); a split whose every owed row went out is
    `finished` until the client reports it to the master, and stays in `done` (its epoch's list) until the epoch is
    known complete. Memory: the splits in hand and the open epochs' split ids, never the samples."""

    def __init__(self, start: Optional[Position] = None) -> None:
        self.owed: dict[tuple[int, int], int] = {}
        self.ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.finished: list[Finished] = []
        self.duplicates = 0
        start = start or Position()
        self.last_epoch = start.last_epoch
        self.done: dict[int, list[int]] = {e: sorted(d) for e, d in start.done.items()}
        # Epochs below this are complete (an epoch up to last_epoch absent from a Position is complete).
        listed = set(start.done) | {e for e, *_ in start.pending}
        self.complete_below = min(listed) if listed else start.last_epoch + 1

    def received(self, epoch: int, split: int, rows: int) -> None:
        key = (epoch, split)
        self.last_epoch = max(self.last_epoch, epoch)
        if rows:
            self.owed[key] = self.owed.get(key, 0) + rows
        else:
            self._finish(Finished(epoch, split, 0))

    def _finish(self, f: Finished) -> None:
        self.finished.append(f)
        if f.epoch >= self.complete_below:
            self.done.setdefault(f.epoch, []).append(f.split)

    def delivered(self, epoch: int, split: int, start: int, stop: int) -> None:
        key = (epoch, split)
        ranges = self.ranges.setdefault(key, [])
        self.duplicates += sum(max(0, min(b, stop) - max(a, start)) for a, b in ranges)
        if ranges and ranges[-1][1] == start:  # pieces mostly come in order: keep one interval
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
        self.owed[key] = self.owed.get(key, 0) - (stop - start)
        if self.owed[key] <= 0:
            del self.owed[key]
            rows = sum(b - a for a, b in self.ranges.pop(key))
            self._finish(Finished(epoch, split, rows))

    def take_finished(self) -> list[Finished]:
        out, self.finished = self.finished, []
        return out

    def prune(self, complete_below: int) -> None:
        """Epochs below `complete_below` are complete job-wide: forget their split ids."""
        if complete_below <= self.complete_below:
            return
        self.complete_below = complete_below
        for e in [e for e in self.done if e < complete_below]:
            del self.done[e]

    def mark(self, batches: int, owed: list[RowRange]) -> ClientMark:
        """The record now: O(open epochs + ranges owed), no copy of the split ids."""
        return ClientMark(batches=batches, complete_below=self.complete_below, last_epoch=self.last_epoch,
                          finished=tuple((e, len(d)) for e, d in self.done.items()), owed=tuple(owed))

    def consumed(self, mark: ClientMark) -> Consumed:
        """The record at `mark` made whole: every epoch from complete_below to last_epoch is listed (an open epoch
        this client finished nothing of yet has an empty set). An epoch pruned since the mark is complete (the
        client prunes PRUNE_LAG_BATCHES after it learns so: later than any mark a trainer still holds)."""
        below = max(mark.complete_below, self.complete_below)
        done: dict[int, set[int]] = {e: set() for e in range(below, mark.last_epoch + 1)}
        for e, n in mark.finished:
            if e >= below:
                done[e] = set(self.done[e][:n])
        return Consumed(Position(last_epoch=mark.last_epoch, done=done, pending=list(mark.owed)),
                        complete_below=below)

    def size(self) -> int:
        """Entries held (splits in hand, their intervals, unreported finishes, open epochs' finished splits)."""
        return (len(self.owed) + sum(len(r) for r in self.ranges.values()) + len(self.finished)
                + sum(len(d) for d in self.done.values()))


class DeliveryLog:
    """Every sample a client hands out, as (epoch, sample_id) int64 pairs appended to a file (flushed per batch):
    what a user checks exactly-once delivery with, across ranks and failures (NEOCFG_DPP_AUDIT)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("ab")

    def write(self, epoch: int, sample_ids: np.ndarray) -> None:
        pairs = np.empty((len(sample_ids), 2), dtype=np.int64)
        pairs[:, 0], pairs[:, 1] = epoch, sample_ids
        pairs.tofile(self.file)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    @staticmethod
    def read(path: Path) -> np.ndarray:
        """The [n, 2] (epoch, sample_id) pairs of one log (a partly written last pair is dropped)."""
        raw = np.fromfile(path, dtype=np.int64)
        return raw[: len(raw) // 2 * 2].reshape(-1, 2)
