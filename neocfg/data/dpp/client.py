"""A trainer's DPP client: pulls finished splits, hands out batches of exactly batch_size, measures the data stall.

Full batches made by the workers go out as they are; the shorter tail of each split waits in a pool and goes out
once the pool holds a batch's worth (so a batch may mix splits and epochs, each sample still exactly once). Every
row range handed out is recorded, so the client can report a Position that a restarted service resumes from.

The client tracks progress per split it holds (neocfg/data/dpp/progress.py Tracker) and reports each split it
delivered whole to the master with its next pull. It keeps its own record of what it consumed (the splits it
delivered whole per open epoch, the ranges it owes): `mark()` takes it before any batch without a message to the
master, and a checkpoint turns a mark into the Position (`consumed`, then the backend's `position`). The stall clock
counts samples, not splits: a client that receives only empty splits (a filter that keeps nothing) for
stall_timeout_s raises, as does one that receives nothing.

A client started from a Position first collects the owed row ranges (the master queues their splits first) and lays
them out as the interrupted client held them, then goes on; with one worker the service hands out splits in queue
order, so the resumed run gets exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from neocfg.data.arrays import BatchArrays
from neocfg.data.dpp.backend import DppBackend
from neocfg.data.dpp.master import DataStall
from neocfg.data.dpp.progress import ClientMark, Consumed, DeliveryLog, Position, RowRange, Tracker
from neocfg.data.dpp.worker import Piece, SplitResult
from neocfg.errors import DataError

# Skipped bad splits (dsi.on_bad_split=skip) are said on the console as they happen, up to this many per client.
SKIPPED_SHOWN = 5
# An epoch the master reports complete is forgotten this many batches later: a trainer holds marks of the few batches
# it fetched ahead (its pipeline, at most 3), and ranks in lockstep are within a step of each other, so every mark
# still in use was taken after each rank trained the batches that completed the epoch.
PRUNE_LAG_BATCHES = 16


class EndOfData(Exception):
    """A finite service (max_epochs) has delivered everything."""


@dataclass
class _Held:
    epoch: int
    split: int
    piece: Piece


class DppClient:
    def __init__(self, backend: DppBackend, index: int, batch_size: int, timeout_s: float,
                 start: Position | None = None) -> None:
        """`start`: the position the service resumes from (its finished splits are part of this client's record)."""
        self.backend, self.index, self.batch_size = backend, index, batch_size
        self.tracker, self.timeout_s = Tracker(start), timeout_s
        self.batches = 0
        # (complete_below, the batch count from which to prune): what the master said, applied PRUNE_LAG_BATCHES late.
        self._prune: deque[tuple[int, int]] = deque()
        # Owed ranges to lay out first (resume), the pieces collected for them, results that came in meanwhile.
        self.restore: list[RowRange] = []
        self._restored: dict[tuple[int, int, int], Piece] = {}
        self._deferred: list[SplitResult] = []
        self.full: deque[_Held] = deque()
        self.tails: deque[_Held] = deque()
        self.tail_rows = 0
        self.ended = False
        self.wait_s = 0.0
        self.delivered = 0
        self.skipped = 0
        self.empty_splits = 0
        self._last_rows_at: float | None = None  # the stall clock starts with the first pull
        # The first batch waits for the workers to start; the steady-state stall is measured after it.
        self.first_wait_s: float | None = None
        self.first_return: float | None = None
        self.log: DeliveryLog | None = None  # every sample handed out, with its epoch (an audit)

    def next_arrays(self) -> BatchArrays:
        """The next batch: exactly batch_size rows (a finite service's very last batch may be shorter)."""
        t0 = time.perf_counter()
        try:
            return self._next()
        finally:
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            self.backend.report_wait(self.index, t1 - t0)
            if self.first_return is None:
                self.first_wait_s, self.first_return = t1 - t0, t1

    def resume_order(self, pending: list[RowRange]) -> None:
        """Hand out these owed ranges first, in this order (a Position's `pending`; single-client services)."""
        self.restore = list(pending)

    def _next(self) -> BatchArrays:
        while True:
            if self.restore:
                self._collect_restore()
                continue
            if self.full:
                return self._emit([self.full.popleft()])
            if self.tail_rows >= self.batch_size or (self.ended and self.tail_rows):
                return self._emit(self._take_tails())
            if self.ended:
                raise EndOfData
            result = self._pull()
            if result is None:
                self.ended = True
                continue
            self._accept(result)

    def _pull(self) -> SplitResult | None:
        """The next split; raises once no *sample* came for timeout_s (empty splits do not count as progress)."""
        if self._last_rows_at is None:
            self._last_rows_at = time.monotonic()
        left = self.timeout_s - (time.monotonic() - self._last_rows_at)
        try:
            if left <= 0:
                raise DataStall(f"DPP: no sample for {self.timeout_s:.0f} s (dsi.stall_timeout_s)")
            result = self.backend.pull(self.index, left, self.tracker.take_finished())
        except DataStall as exc:
            if not self.empty_splits:
                raise
            raise DataError(f"DPP: no sample for {self.timeout_s:.0f} s (dsi.stall_timeout_s); {self.empty_splits} "
                            f"splits came back empty after the transforms (dsi.transforms filters)") from exc
        if result is not None:
            if result.complete_below > max([self.tracker.complete_below, *(w for w, _ in self._prune)]):
                self._prune.append((result.complete_below, self.batches + PRUNE_LAG_BATCHES))
            if result.delivered_rows:
                self._last_rows_at: float | None = None  # the stall clock starts with the first pull
            elif result.skipped is None:
                self.empty_splits += 1
            self._note_skipped(result)
        return result

    def _note_skipped(self, result: SplitResult) -> None:
        if result.skipped is None:
            return
        self.skipped += 1
        if self.skipped <= SKIPPED_SHOWN:
            more = " (further skips are counted in metrics.json)" if self.skipped == SKIPPED_SHOWN else ""
            print(f"warning: skipped a bad split (dsi.on_bad_split=skip): {result.skipped}{more}", flush=True)

    def _accept(self, result: SplitResult) -> None:
        epoch, split = result.task.epoch, result.task.split.index
        self.tracker.received(epoch, split, result.delivered_rows)
        for p in result.pieces:
            self._hold(_Held(epoch, split, p))

    def _hold(self, held: _Held) -> None:
        if held.piece.arrays.rows == self.batch_size:
            self.full.append(held)
        else:
            self.tails.append(held)
            self.tail_rows += held.piece.arrays.rows

    def _collect_restore(self) -> None:
        """Pull until every owed range is back, then hold the pieces in the recorded order."""
        wanted = {(e, s) for e, s, _, _ in self.restore}
        result = self._pull()
        if result is None:
            self.restore = []  # a finite service ended: nothing more is coming
        elif (result.task.epoch, result.task.split.index) in wanted and result.task.keep is not None:
            epoch, split = result.task.epoch, result.task.split.index
            self.tracker.received(epoch, split, result.delivered_rows)
            for p in result.pieces:
                self._restored[(epoch, split, p.start)] = p
            if result.skipped is not None:  # the split went bad since: nothing of it is owed any more
                self.restore = [r for r in self.restore if (r[0], r[1]) != (epoch, split)]
        else:
            self._deferred.append(result)
        if all((e, s, a) in self._restored for e, s, a, _ in self.restore):
            for e, s, a, _ in self.restore:
                self._hold(_Held(e, s, self._restored.pop((e, s, a))))
            self.restore = []
            for r in self._deferred:
                self._accept(r)
            self._deferred = []
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
            self.tracker.delivered(h.epoch, h.split, h.piece.start, h.piece.start + h.piece.arrays.rows)
        batch = BatchArrays.concat([h.piece.arrays for h in parts])
        if self.log is not None:
            for h in parts:
                self.log.write(h.epoch, h.piece.arrays.sample_ids)
            self.log.flush()
        self.delivered += batch.rows
        self.batches += 1
        while self._prune and self._prune[0][1] <= self.batches:
            self.tracker.prune(self._prune.popleft()[0])
        return batch

    def mark(self) -> ClientMark:
        """The record after the batches handed out so far (local and cheap: take it before every batch): the
        splits delivered whole, and every range still owed in hand-out order (ranges still being collected after a
        resume are owed too)."""
        held = [(h.epoch, h.split, h.piece.start, h.piece.start + h.piece.arrays.rows)
                for h in [*self.full, *self.tails]]
        return self.tracker.mark(self.batches, [*self.restore, *held])

    def consumed(self, mark: ClientMark | None = None) -> Consumed:
        """What this client consumed up to `mark` (default: now), for a checkpoint."""
        return self.tracker.consumed(mark or self.mark())

    @property
    def stall_fraction(self) -> float:
        """Steady-state share of the trainer's time spent waiting for data: wait after the first batch over the wall
        time since the first batch came back (the first one waits for worker start-up, reported on its own)."""
        if self.first_return is None:
            return 0.0
        return (self.wait_s - self.first_wait_s) / max(time.perf_counter() - self.first_return, 1e-9)
