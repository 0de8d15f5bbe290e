"""Progress bookkeeping of the DPP service, free of processes and threads (unit-testable on its own).

Position   how far the trainers got: for each epoch not yet complete, the splits whose rows were all delivered and,
           for splits delivered in part, the row ranges still owed. Rows of a split are numbered in their order after
           the transforms, which is deterministic, so a range names the same samples on every re-read.
SplitQueue the master's queue of tasks (epoch, split, ranges to deliver): epochs in a seeded shuffled split order,
           an epoch's tasks queued only once the previous epoch's are all handed out, requeued tasks first.
Tracker    a client's record of what it received and delivered, from which it reports its Position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from neocfg.data.dataset import Split

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Task:
    epoch: int
    split: Split
    # Row ranges to deliver (after transforms); None means every row of the split.
    keep: Optional[Ranges] = None


@dataclass
class EpochProgress:
    done: set[int] = field(default_factory=set)
    partial: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class Position:
    """Where delivery stands. `last_epoch` is the newest epoch anything was received from (-1: none)."""

    last_epoch: int = -1
    epochs: dict[int, EpochProgress] = field(default_factory=dict)

    def to_state(self) -> dict[str, Any]:
        """JSON- and torch.save-friendly."""
        def partial(p: EpochProgress) -> list[dict[str, Any]]:
            return [{"split": s, "ranges": [list(r) for r in rs]} for s, rs in sorted(p.partial.items())]

        return {"last_epoch": self.last_epoch,
                "epochs": [{"epoch": e, "done": sorted(p.done), "partial": partial(p)}
                           for e, p in sorted(self.epochs.items())]}

    @staticmethod
    def from_state(state: dict[str, Any]) -> "Position":
        epochs = {int(e["epoch"]): EpochProgress(done={int(s) for s in e["done"]},
                                                  partial={int(p["split"]): [(int(a), int(b)) for a, b in p["ranges"]]
                                                           for p in e["partial"]})
                  for e in state["epochs"]}
        return Position(last_epoch=int(state["last_epoch"]), epochs=epochs)

    @staticmethod
    def merge(positions: list["Position"], num_splits: int) -> "Position":
        """The position of several clients of one service (each split went to exactly one of them)."""
        out = Position(last_epoch=max([p.last_epoch for p in positions], default=-1))
        for p in positions:
            for e, ep in p.epochs.items():
                mine = out.epochs.setdefault(e, EpochProgress())
                mine.done |= ep.done
                mine.partial.update(ep.partial)
        # Each client lists every epoch up to its newest until it is complete; an epoch absent everywhere is.
        for e in list(out.epochs):
            if len(out.epochs[e].done) == num_splits:
                del out.epochs[e]
        return out


def epoch_order(num_splits: int, epoch: int, seed: int) -> list[int]:
    """The split order of an epoch: a permutation seeded by (seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_splits)]


class SplitQueue:
    """Tasks in order; `max_epochs=None` rolls over epochs forever."""

    def __init__(self, splits: list[Split], seed: int, max_epochs: Optional[int], start: Position) -> None:
        self.splits, self.seed, self.max_epochs = splits, seed, max_epochs
        self.todo: deque[Task] = deque()
        for e in sorted(start.epochs):
            self._queue_epoch(e, start.epochs[e])
        self.next_epoch = start.last_epoch + 1

    def _queue_epoch(self, epoch: int, progress: EpochProgress) -> None:
        for i in epoch_order(len(self.splits), epoch, self.seed):
            if i in progress.done:
                continue
            keep = tuple(tuple(r) for r in progress.partial[i]) if i in progress.partial else None
            self.todo.append(Task(epoch=epoch, split=self.splits[i], keep=keep))

    def next(self) -> Optional[Task]:
        if not self.todo and (self.max_epochs is None or self.next_epoch < self.max_epochs):
            self._queue_epoch(self.next_epoch, EpochProgress())
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
        self.done: dict[int, set[int]] = {e: set(p.done) for e, p in start.epochs.items()}
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

    def position(self, pending: list[tuple[int, int, int, int]]) -> Position:
        """`pending`: (epoch, split, start, stop) of every row range received but not delivered."""
        pos = Position(last_epoch=self.last_epoch, epochs={e: EpochProgress(done=set(d)) for e, d in self.done.items()})
        for epoch, split, start, stop in pending:
            ep = pos.epochs.setdefault(epoch, EpochProgress())
            ep.partial.setdefault(split, []).append((start, stop))
        for ep in pos.epochs.values():
            for rs in ep.partial.values():
                rs.sort()
        return pos
