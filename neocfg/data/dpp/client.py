"""A trainer's DPP client: pulls finished splits, hands out batches of exactly batch_size, measures the data stall.

Full batches made by the workers go out as they are; the shorter tail of each split waits in a pool and goes out
once the pool holds a batch's worth (so a batch may mix splits and epochs, each sample still exactly once). Every
row range handed out is recorded, so the client can report a Position that a restarted service resumes from.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from neocfg.data.arrays import BatchArrays
from neocfg.data.dpp.backend import DppBackend
from neocfg.data.dpp.progress import Position, Tracker
from neocfg.data.dpp.worker import Piece


class EndOfData(Exception):
    """A finite service (max_epochs) has delivered everything."""


@dataclass
class _Held:
    epoch: int
    split: int
    piece: Piece


class DppClient:
    def __init__(self, backend: DppBackend, index: int, batch_size: int, tracker: Tracker, timeout_s: float) -> None:
        self.backend, self.index, self.batch_size = backend, index, batch_size
        self.tracker, self.timeout_s = tracker, timeout_s
        self.full: deque[_Held] = deque()
        self.tails: deque[_Held] = deque()
        self.tail_rows = 0
        self.ended = False
        self.wait_s = 0.0
        self.delivered = 0
        self.skipped = 0
        self.first_call: float | None = None

    def next_arrays(self) -> BatchArrays:
        """The next batch: exactly batch_size rows (a finite service's very last batch may be shorter)."""
        t0 = time.perf_counter()
        if self.first_call is None:
            self.first_call = t0
        try:
            return self._next()
        finally:
            waited = time.perf_counter() - t0
            self.wait_s += waited
            self.backend.report_wait(self.index, waited)

    def _next(self) -> BatchArrays:
        while True:
            if self.full:
                return self._emit([self.full.popleft()])
            if self.tail_rows >= self.batch_size or (self.ended and self.tail_rows):
                return self._emit(self._take_tails())
            if self.ended:
                raise EndOfData
            result = self.backend.pull(self.index, self.timeout_s)
            if result is None:
                self.ended = True
                continue
            self.skipped += result.skipped is not None
            epoch, split = result.task.epoch, result.task.split.index
            self.tracker.received(epoch, split, result.delivered_rows)
            for p in result.pieces:
                held = _Held(epoch, split, p)
                if p.arrays.rows == self.batch_size:
                    self.full.append(held)
                else:
                    self.tails.append(held)
                    self.tail_rows += p.arrays.rows

    def _take_tails(self) -> list[_Held]:
        need, out = self.batch_size, []
        while need and self.tails:
            head = self.tails[0]
            n = head.piece.arrays.rows
            if n <= need:
                out.append(self.tails.popleft())
                need -= n
                self.tail_rows -= n
            else:
                a = head.piece.arrays
                out.append(_Held(head.epoch, head.split, Piece(head.piece.start, a.slice(0, need))))
                head.piece = Piece(head.piece.start + need, a.slice(need, n))
                self.tail_rows -= need
                need = 0
        return out

    def _emit(self, parts: list[_Held]) -> BatchArrays:
        for h in parts:
            self.tracker.delivered(h.epoch, h.split, h.piece.arrays.sample_ids)
        batch = BatchArrays.concat([h.piece.arrays for h in parts])
        self.delivered += batch.rows
        return batch

    def position(self) -> Position:
        pending = [(h.epoch, h.split, h.piece.start, h.piece.start + h.piece.arrays.rows)
                   for h in [*self.full, *self.tails]]
        return self.tracker.position(pending)

    @property
    def stall_fraction(self) -> float:
        """Wait time over the wall time since the first request: the share of the trainer loop spent on data."""
        if self.first_call is None:
            return 0.0
        return self.wait_s / max(time.perf_counter() - self.first_call, 1e-9)
