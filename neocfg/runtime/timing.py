"""Per-step time accounting of one rank: categories of milliseconds (StepTimes) and the Stopwatch that fills them.

On a CPU rank every mark is the host clock and a lap is counted when it ends. On a GPU the work is asynchronous:
host clocks would time the launches, and a `torch.cuda.synchronize()` per lap (what the first version did) removes
all overlap of copies, collectives and kernels. So on CUDA a mark is a CUDA event recorded on the current stream
and laps are resolved later, from `Event.elapsed_time`, with one synchronize when the run reports (`resolve()`).
`train.profile=true` synchronizes at every mark instead (exact attribution per category, no overlap): for
profiling, not for throughput.

A CPU rank shares its core with its data source's prefetch thread (batch production, and the ids exchange where it
runs there). With that thread watched (`watch_helper`), a mark also reads the thread's own CPU clock, and every lap is
the wall time less the CPU time the thread took meanwhile; that CPU time is the step's `prefetch` lap. So the laps
partition the step: what overlaps is counted once, in the lap of the thread that did the work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch


@dataclass
class StepTimes:
    """Milliseconds spent per category during one step on this rank."""

    data_wait: float = 0.0
    emb_fwd: float = 0.0
    emb_bwd: float = 0.0
    comm_input: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    # data-parallel replicas' backward (runtime/replicated.py): their dense gradient and update; their all-reduce
    dp_update: float = 0.0
    comm_dp: float = 0.0
    dense: float = 0.0
    # CPU ranks: the prefetch thread's CPU time during the step (taken out of the laps above, see watch_helper)
    prefetch: float = 0.0
    total: float = 0.0

    def add(self, name: str, ms: float) -> None:
        setattr(self, name, getattr(self, name) + ms)


@dataclass(frozen=True)
class HostMark:
    """A point in time on a CPU rank: the host clock and the CPU time its watched helper thread had used (seconds)."""

    wall: float
    helper: float = 0.0

    def __sub__(self, other: "HostMark") -> float:
        """Seconds of this thread's own lap: the wall time between the marks less the helper's CPU time in it."""
        return (self.wall - other.wall) - (self.helper - other.helper)


# A point in time: the host clock (seconds, with the helper thread's CPU clock on a CPU rank), or a CUDA event
# recorded on the current stream.
Mark = Union[float, HostMark, "torch.cuda.Event"]


@dataclass
class _Pending:
    """Laps and derived terms of one step whose CUDA events have not been read yet."""

    times: StepTimes
    laps: list[tuple[str, "torch.cuda.Event", "torch.cuda.Event"]] = field(default_factory=list)
    less: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


class BackwardMark(torch.autograd.Function):
    """Identity; its backward calls note() when the gradient reaches this point (e.g. to record when a backward
    part starts: Stopwatch.note_grad_arrival, the data-parallel replicas' backward)."""

    @staticmethod
    def forward(ctx, note: Callable[[], None], x: torch.Tensor) -> torch.Tensor:
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.note()
        return None, g


class Stopwatch:
    """`with sw("comm_fwd"):` adds the block's time to sw.times.comm_fwd; sw.span(name, a, b) adds b - a."""

    def __init__(self, device: torch.device, profile: bool = False) -> None:
        self.events = device.type == "cuda" and not profile
        self.sync = device.type == "cuda" and profile
        self._pending: list[_Pending] = []
        self.times = StepTimes()
        # When the pooled-output gradient reached the fused TBEs in the last backward, and when the last of them
        # finished its backward (the fused update included; set by the embeddings).
        self.grad_arrival: Optional[Mark] = None
        self.lookups_done: Optional[Mark] = None
        self.host = device.type == "cpu"
        self._helper_clock: Optional[int] = None

    @property
    def watching(self) -> bool:
        return self._helper_clock is not None

    def watch_helper(self, thread_ident: int) -> None:
        """CPU ranks: take the CPU time of this thread (the data source's prefetch thread) out of every lap and count
        it as the step's `prefetch` lap. A no-op where the platform has no per-thread CPU clocks."""
        if self.host and hasattr(time, "pthread_getcpuclockid"):
            self._helper_clock = time.pthread_getcpuclockid(thread_ident)

    @property
    def times(self) -> StepTimes:
        return self._times

    @times.setter
    def times(self, value: StepTimes) -> None:
        """A new step: its laps go to `value` (filled at once on CPU, at resolve() with CUDA events)."""
        self._times = value
        if self.events:
            self._pending.append(_Pending(value))

    def note_grad_arrival(self) -> None:
        """The pooled-output gradient reached the fused TBEs (BackwardMark's note, in the embeddings' backward)."""
        self.grad_arrival = self.now()

    def note_lookup_done(self) -> None:
        """A fused TBE's backward (and its fused update) finished: a post-hook of its autograd node. The last call of
        a backward ends the emb_bwd lap, before whatever the backward call waits for after it (DDP's last
        all-reduces)."""
        self.lookups_done = self.now()

    def now(self) -> Mark:
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        if self.sync:
            torch.cuda.synchronize()
        if self.host:
            wall = time.perf_counter()
            return HostMark(wall, time.clock_gettime(self._helper_clock) if self._helper_clock is not None else 0.0)
        return time.perf_counter()

    def span(self, name: str, start: Mark, end: Mark) -> None:
        if self.events:
            self._pending[-1].laps.append((name, start, end))
        else:
            self._times.add(name, (end - start) * 1e3)

    def exclude(self, name: str, start: Mark, end: Mark) -> None:
        """name -= end - start (a lap of another category inside a span of `name`)."""
        self.span(name, end, start)

    def span_step(self, start: Mark, end: Mark) -> None:
        """The whole step: `total` its wall time, `prefetch` the watched helper's CPU time in it (CPU ranks; the
        other laps are net of it, so they add up to the total)."""
        if isinstance(start, HostMark) and isinstance(end, HostMark):
            self._times.add("total", (end.wall - start.wall) * 1e3)
            self._times.add("prefetch", (end.helper - start.helper) * 1e3)
        else:
            self.span("total", start, end)

    def subtract(self, name: str, *parts: str) -> None:
        """name -= the sum of parts (for a span that contains them), applied after this step's laps."""
        if self.events:
            self._pending[-1].less.append((name, parts))
        else:
            self._times.add(name, -sum(getattr(self._times, p) for p in parts))

    def resolve(self) -> None:
        """Fill every step's times from its CUDA events (one synchronize); nothing to do on CPU."""
        if not self._pending:
            return
        torch.cuda.synchronize()
        for p in self._pending:
            for name, start, end in p.laps:
                p.times.add(name, start.elapsed_time(end))
            for name, parts in p.less:
                p.times.add(name, -sum(getattr(p.times, q) for q in parts))
        self._pending = [_Pending(self._times)]   # laps of the current step still to come

    def __call__(self, name: str) -> "_Lap":
        return _Lap(self, name)


@dataclass
class _Lap:
    sw: Stopwatch
    name: str
    t0: Mark = 0.0

    def __enter__(self) -> None:
        self.t0 = self.sw.now()

    def __exit__(self, *exc) -> None:
        self.sw.span(self.name, self.t0, self.sw.now())

