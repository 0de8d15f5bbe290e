"""Progress bookkeeping of the DPP service, free of processes and threads (unit-testable on its own).

Position   how far the trainers got: for each epoch not yet complete, the splits whose rows were all delivered, and
           the row ranges received but still owed. Rows of a split are numbered in their order after the transforms,
           which is deterministic, so a range names the same samples on every re-read.
SplitQueue the master's queue of tasks (epoch, split, ranges to deliver): epochs in a seeded shuffled split order,
           an epoch's tasks queued only once the previous epoch's are all handed out, requeued tasks first.
SplitMeta  what the master learns of a finished split; Finished: a client delivered every owed row of a split.
Tracker    a client's per-split progress (rows owed, intervals delivered), reported to the master split by split.
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
    def merge(positions: list["Position"], num_splits: int) -> "Position":
        """The position of several clients of one service (each split went to exactly one of them)."""
        out = Position(last_epoch=max([p.last_epoch for p in positions], default=-1))
        for p in positions:
            for e, d in p.done.items():
                out.done.setdefault(e, set()).update(d)
            out.pending += p.pending
        # Each client lists every epoch up to its newest until it is complete; an epoch absent everywhere is.
        for e in [e for e, d in out.done.items() if len(d) == num_splits]:
            del out.done[e]
        return out


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
    `finished` until the client reports it to the master. Memory: the splits in hand, never the samples."""

    def __init__(self) -> None:
        self.owed: dict[tuple[int, int], int] = {}
        self.ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.finished: list[Finished] = []
        self.duplicates = 0

    def received(self, epoch: int, split: int, rows: int) -> None:
        key = (epoch, split)
        if rows:
            self.owed[key] = self.owed.get(key, 0) + rows
        else:
            self.finished.append(Finished(epoch, split, 0))

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
            self.finished.append(Finished(epoch, split, rows))

    def take_finished(self) -> list[Finished]:
        out, self.finished = self.finished, []
        return out

    def size(self) -> int:
        """Entries held (splits in hand, their intervals, unreported finishes)."""
        return len(self.owed) + sum(len(r) for r in self.ranges.values()) + len(self.finished)
