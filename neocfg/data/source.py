"""Where a trainer rank gets its batches: the interface the runtime consumes and its implementations.

A BatchSource yields fixed-size batches for one rank forever (epochs roll over), can report its position for a
checkpoint and resume from it, and counts the time the trainer waited on it (the data stall).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from neocfg.batch import Batch
from neocfg.config.schema import NeocfgConfig
from neocfg.data.arrays import BatchArrays
from neocfg.data.synthetic import SyntheticData, as_batch
from neocfg.types import DataSource

if TYPE_CHECKING:
    from neocfg.data.dpp.sizing import PlannedDpp


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters merged into metrics.json (e.g. data_stall_seconds, samples_delivered)."""
        ...

    def close(self) -> None: ...


class SyntheticSource:
    """Rank r's step s is samples [(s * world + r) * B, ... + B) of an epoch of `num_samples` distinct samples
    (dsi.num_samples; positions wrap around, so epoch e repeats epoch 0's samples in the same order; None: no end):
    disjoint over ranks within an epoch, identical on every run.

    cycle > 0 (dsi.cycle_batches): the first `cycle` of those batches are generated once, at construction, and
    handed out in a cycle (TorchRec's RandomRecDataset with num_generated_batches): for measuring the step, with no
    generation beside it; the model then sees only cycle x B x world distinct samples."""

    def __init__(self, data: SyntheticData, rank: int, world_size: int, batch_size: int, first_sample: int = 0,
                 num_samples: Optional[int] = None, cycle: int = 0, pin_memory: bool = False):
        self.data, self.rank, self.world, self.batch_size = data, rank, world_size, batch_size
        self.first_sample, self.num_samples = first_sample, num_samples
        self.step = 0
        self.wait_s = 0.0
        self.delivered = 0
        self.cycled = [self._generate(s) for s in range(cycle)]
        if pin_memory:
            self.cycled = [b.pin_memory() for b in self.cycled]

    @property
    def pregenerated(self) -> bool:
        """Every batch it hands out exists already (cycle > 0): next_batch produces nothing."""
        return bool(self.cycled)

    def _generate(self, step: int) -> Batch:
        return self._samples((step * self.world + self.rank) * self.batch_size, self.batch_size)

    def next_batch(self) -> Batch:
        t0 = time.perf_counter()
        batch = self.cycled[self.step % len(self.cycled)] if self.cycled else self._generate(self.step)
        self.step += 1
        self.delivered += self.batch_size
        self.wait_s += time.perf_counter() - t0
        return batch

    def _samples(self, position: int, count: int) -> Batch:
        """`count` samples from `position` of the endless sequence of epochs."""
        n = self.num_samples
        if n is None:
            return self.data.batch(self.first_sample + position, count)
        runs, at, left = [], position % n, count
        while left:
            take = min(left, n - at)
            runs.append(self.data.batch_arrays(self.first_sample + at, take))
            at, left = 0, left - take
        return as_batch(BatchArrays.concat(runs))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def stats(self) -> dict[str, Any]:
        return {"data_wait_seconds": self.wait_s, "samples_delivered": self.delivered}

    def close(self) -> None:
        pass


class Prefetcher:
    """Prepares the next batch of `inner` in a background thread while the caller's step runs.

    At most one batch is in flight. prepare_with(fn) makes the thread also run fn on every batch it produces (the
    consumer's own work on a batch that needs nothing else, e.g. the trainer's id exchange), so that it overlaps the
    step too. state_dict() is the inner source's state right after the last batch handed
    out was produced (so a resume neither skips nor repeats the prefetched batch); stats() counts as data wait only
    the time next_batch() blocked on the thread. Pre-generated batches (SyntheticSource.pregenerated) with nothing
    to prepare are handed out in the caller's thread: there is nothing to overlap.
    idle: the thread runs in Linux's SCHED_IDLE class (the plan's StepStrategies.prefetch_idle): only when nothing
    else wants its core, so on a CPU rank it fills the main thread's waits instead of taking turns with its compute.
    """

    def __init__(self, inner: BatchSource, pin_memory: bool = False, idle: bool = False) -> None:
        self.inner, self.pin_memory = inner, pin_memory
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neocfg-prefetch",
                                       initializer=_idle_thread if idle else None)
        self.pending: Optional[Future] = None
        self.delivered_state = inner.state_dict()
        self.wait_s = 0.0
        self.delivered = 0
        self.prepare: Optional[Callable[[Batch], Batch]] = None
        self.prepared = 0
        self.prepare_s = 0.0

    def thread_ident(self) -> int:
        """The prefetch thread's identifier (threading.get_ident in it); it starts the thread if none runs yet."""
        return self.pool.submit(threading.get_ident).result()

    def prepare_with(self, fn: Callable[[Batch], Batch]) -> None:
        """Run fn(batch) -> batch in the prefetch thread on every batch produced after this call (call it before
        the first next_batch: a batch already in flight would be handed out without it)."""
        self.prepare = fn

    def _produce(self) -> tuple[Batch, dict[str, Any]]:
        batch = self.inner.next_batch()
        if self.pin_memory and not batch.values.is_pinned():   # (a cycled batch is pinned once)
            batch = batch.pin_memory()
        if self.prepare is not None:
            t0 = time.perf_counter()
            batch = self.prepare(batch)
            self.prepare_s += time.perf_counter() - t0
            self.prepared += 1
        return batch, self.inner.state_dict()

    def next_batch(self) -> Batch:
        t0 = time.perf_counter()
        if self.prepare is None and self.pending is None and getattr(self.inner, "pregenerated", False):
            # nothing to produce or prepare (pre-generated batches, pinned already): handed out here, without a
            # hand-off to the thread and back every step
            batch, self.delivered_state = self._produce()
            self.wait_s += time.perf_counter() - t0
            self.delivered += batch.batch_size
            return batch
        future = self.pending or self.pool.submit(self._produce)
        batch, self.delivered_state = future.result()
        self.wait_s += time.perf_counter() - t0
        self.delivered += batch.batch_size
        self.pending = self.pool.submit(self._produce)
        return batch

    def _drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def state_dict(self) -> dict[str, Any]:
        return self.delivered_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drain()
        self.inner.load_state_dict(state)
        self.delivered_state = self.inner.state_dict()

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats())
        # The inner source's clock counts production, which overlaps the steps; the wait is ours.
        out["data_produce_seconds"] = out.get("data_wait_seconds", 0.0)
        out["data_wait_seconds"] = self.wait_s
        out["samples_delivered"] = self.delivered
        # prepare_with's function: batches (in-flight ones included) and seconds (beside the step, like production)
        out["batches_prepared"] = self.prepared
        out["data_prepare_seconds"] = self.prepare_s
        return out

    def close(self) -> None:
        self._drain()
        self.pool.shutdown(wait=True)
        self.inner.close()


def _idle_thread() -> None:
    """The calling thread into SCHED_IDLE (on Linux a thread is scheduled on its own: pid 0 is this thread);
    where the platform has no such class, a warning, and the thread stays in the default one."""
    if not hasattr(os, "SCHED_IDLE"):
        warnings.warn("train.prefetch_priority: this platform has no SCHED_IDLE; the prefetch thread keeps the default "
                      "priority", RuntimeWarning, stacklevel=2)
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


# Held-out samples start here, far past any training range, so evaluation never sees a training sample.
EVAL_FIRST_SAMPLE = 1 << 40


def make_source(cfg: NeocfgConfig, rank: int, world_size: int, *, eval: bool = False,
                sizing: Optional["PlannedDpp"] = None, share: Optional[Callable[[Any], Any]] = None,
                pin_memory: bool = False, prefetch_idle: bool = False) -> BatchSource:
    """The batch source for one trainer rank, chosen by cfg.dsi.source.

    dsi.source=parquet: DPP services (neocfg/data/dpp_source.py); `sizing` is the planner's DPP sizing for
    dsi.workers=auto, handed over by the runtime (PlannedDpp.from_plan); `share` gives rank 0's value to every rank
    (a broadcast; the Ray backend shares its cluster address with it). pin_memory: synthetic batches are pinned in
    the prefetch thread (for non_blocking copies to a GPU); prefetch_idle: that thread at idle priority (Prefetcher).
    """
    if cfg.dsi.source is DataSource.parquet:
        from neocfg.data.dpp_source import make_dpp_source

        return make_dpp_source(cfg, rank, world_size, eval=eval, sizing=sizing, share=share)
    data = SyntheticData.for_model(cfg.model, cfg.dsi.seed)
    d, b = cfg.dsi, cfg.train.batch_size
    # held-out batches: a stream of samples no training epoch holds
    first, epoch = (EVAL_FIRST_SAMPLE, None) if eval else (0, d.num_samples)
    if epoch is not None and rank == 0 and b * world_size > epoch:
        print(f"warning: train.batch_size={b} x {world_size} ranks = {b * world_size:,} samples per step is more than"
              f" dsi.num_samples={epoch:,} (the synthetic epoch): every step repeats samples", flush=True)
    inner = SyntheticSource(data, rank, world_size, b, first_sample=first, num_samples=epoch,
                            cycle=0 if eval else d.cycle_batches,   # held-out samples are never cycled
                            pin_memory=pin_memory)
    return Prefetcher(inner, pin_memory=pin_memory, idle=prefetch_idle)
