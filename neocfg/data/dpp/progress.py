"""Progress bookkeeping of the DPP service, free of processes and threads (unit-testable on its own).

Position   how far the trainers got: for each epoch not yet complete, the splits whose rows were all delivered, and
           the row ranges received but still owed. Rows of a split are numbered in their order after the transforms,
           which is deterministic, so a range names the same samples on every re-read.
SplitQueue the master's queue of tasks (epoch, split, ranges to deliver): epochs in a seeded shuffled split order,
           an epoch's tasks queued only once the previous epoch's are all handed out, requeued tasks first.
Tracker    a client's record of what it received and delivered, from which it reports its Position.
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
    """What one client received and delivered; epochs drop out once all their splits are delivered."""

    def __init__(self, num_splits: int, start: Position) -> None:
        self.num_splits = num_splits
        self.last_epoch = start.last_epoch
        self.done: dict[int, set[int]] = {e: set(d) for e, d in start.done.items()}
        # Rows still owed per (epoch, split): received but not yet delivered.
        self.owed: dict[tuple[int, int], int] = {}
        self.seen: dict[int, set[int]] = {}
        self.duplicates = 0

    def received(self, epoch: int, split: int, rows: int) -> None:
        # Every epoch up to the newest one received stays listed until complete: a result of epoch e + 1 can
        # arrive before any of epoch e (a slow worker), and e must not then look finished.
        for e in range(self.last_epoch + 1, epoch + 1):
            self.done.setdefault(e, set())
        self.last_epoch = max(self.last_epoch, epoch)
        if rows:
            self.owed[(epoch, split)] = rows
        else:
            self._finish(epoch, split)

    def delivered(self, epoch: int, split: int, sample_ids: np.ndarray) -> None:
        seen = self.seen.setdefault(epoch, set())
        before = len(seen)
        seen.update(sample_ids.tolist())
        self.duplicates += len(sample_ids) - (len(seen) - before)
        key = (epoch, split)
        self.owed[key] -= len(sample_ids)
        if self.owed[key] == 0:
            del self.owed[key]
            self._finish(epoch, split)

    def _finish(self, epoch: int, split: int) -> None:
        done = self.done.setdefault(epoch, set())
        done.add(split)
        if len(done) == self.num_splits:
            del self.done[epoch]
            self.seen.pop(epoch, None)

    def position(self, pending: list[RowRange]) -> Position:
        """`pending`: every row range received but not delivered, in hand-out order."""
        return Position(last_epoch=self.last_epoch, done={e: set(d) for e, d in self.done.items()},
                        pending=list(pending))
