"""Advice that has been checked: when planning fails, the message names only changes that the planner has verified
to make the plan fit, and of each kind the smallest (fewest nodes, largest batch).

The planner's stages explain *why* a model does not fit (a table too large for a device, the cluster's total
memory, the trainer's ingest limit); their own suggestions are first guesses. `plan_or_advise` keeps the reason,
replaces the guesses with verified changes, and says so when no change it tries helps. Every count it gives has been
planned for real by the configured planner (planner.algorithm, the ILP by default, at its own time limit and gap):
the fewest nodes and the largest batch with which that planner fits, bisected. The greedy planner, seconds where the
ILP may take its time limit, only narrows the search: a greedy plan is the ILP's warm start, so where greedy fits
the ILP does too, and the ILP is bisected below greedy's count (it packs memory-tight models on fewer nodes).

Long planning shows progress: `planning_progress` prints a line to stderr every PROGRESS_EVERY_S seconds while the
planner runs (e.g. a long ILP inside a sweep, whose runs print nothing until they end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from neocfg.config.schema import MAX_NODES, NeocfgConfig
from neocfg.errors import InfeasibleError, IngestLimitError, NeocfgError
from neocfg.plan import Plan
from neocfg.types import MemoryTier, PlannerAlgorithm, ShardingType, WeightsDtype

# Seconds between progress lines while planning (NEOCFG_PROGRESS_EVERY_S overrides it, e.g. for tests).
PROGRESS_EVERY_S = 10.0
# Seconds spent verifying changes after a failed plan: every probe is a real plan (an ILP probe may take
# planner.time_limit_s); past this the message gives what has been verified so far and says that it stopped.
ADVICE_BUDGET_S = 300.0
# A probe of the planner that takes at least this long prints a line to stderr as it ends (quick ones stay quiet: the
# error is one line).
ADVICE_REPORT_S = 1.0
# The planners' own suggestions, cut from their messages before the verified ones are appended.
_SUGGESTION = re.compile(r";\s*(would fit with|no allowed setting makes it fit).*$")


@dataclass(frozen=True)
class Change:
    """One verified change: how to write it on the command line, and the config it makes."""

    text: str
    cfg: NeocfgConfig


def _greedy(cfg: NeocfgConfig) -> NeocfgConfig:
    return dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, algorithm=PlannerAlgorithm.greedy))


def fits(cfg: NeocfgConfig) -> bool:
    """Whether the configured planner finds a placement (and a DPP sizing) for cfg: a real plan, not an estimate."""
    from neocfg.planner import make_plan

    try:
        make_plan(cfg)
    except NeocfgError:
        return False
    return True


class _OutOfTime(Exception):
    pass


@dataclass(frozen=True)
class Prober:
    """`fits` with a deadline (raises _OutOfTime once the advice budget is spent), and when `report` one line on stderr
    per probe of the configured planner that took ADVICE_REPORT_S or more (what was tried, the verdict, how long)."""

    deadline: float
    report: bool = False

    def _check(self) -> None:
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def fits(self, cfg: NeocfgConfig, what: str = "") -> bool:
        """The configured planner's verdict."""
        self._check()
        t0 = time.perf_counter()
        ok = fits(cfg)
        if self.report and time.perf_counter() - t0 >= ADVICE_REPORT_S:
            print(f"advice: {what or 'change'} {'fits' if ok else 'does not fit'} ({cfg.planner.algorithm.value},"
                  f" {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return ok

    def greedy_fits(self, cfg: NeocfgConfig) -> bool:
        """The greedy planner's verdict: where it fits, so does the configured planner (for the ILP, it is the
        warm start)."""
        self._check()
        return fits(_greedy(cfg))


def with_nodes(cfg: NeocfgConfig, nodes: int) -> NeocfgConfig:
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, nodes=nodes, world_size=None))


def with_batch(cfg: NeocfgConfig, batch: int) -> NeocfgConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch))


def _with_planner(cfg: NeocfgConfig, **kw: object) -> NeocfgConfig:
    return dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, **kw))


def _bisect(good: int, bad: int, ok: Callable[[int], bool], checked: bool) -> Optional[int]:
    """Bisect between a value that fits (`good`; verified by `ok` when `checked`, otherwise assumed) and one that does
    not (`bad`, above or below it): the fitting value nearest `bad`, verified; None if `good` itself does not fit."""
    while abs(bad - good) > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good, checked = mid, True
        else:
            bad = mid
    return good if checked or ok(good) else None


def _doubling(start: int, ok: Callable[[int], bool]) -> Optional[tuple[int, int]]:
    """From `start` (which does not fit), double up to MAX_NODES: (the last that did not fit, the first that fits)."""
    lo = n = start
    while n < MAX_NODES:
        n = min(MAX_NODES, n * 2)
        if ok(n):
            return lo, n
        lo = n
    return None


def smallest_nodes(cfg: NeocfgConfig, probe: Prober) -> Optional[int]:
    """Fewest nodes (more than now, at most MAX_NODES) with which the configured planner fits cfg, that count planned
    by it: greedy (doubling, then bisection) gives a count that fits, the configured planner is bisected below it."""
    def planner(n: int) -> bool:
        return probe.fits(with_nodes(cfg, n), f"hardware.nodes={n}")

    greedy_only = cfg.planner.algorithm is PlannerAlgorithm.greedy
    bracket = _doubling(cfg.hardware.nodes, lambda n: probe.greedy_fits(with_nodes(cfg, n)))
    if bracket is not None:
        lo, hi = bracket
        g = _bisect(hi, lo, lambda n: probe.greedy_fits(with_nodes(cfg, n)), checked=True)
        if greedy_only or g is None:
            return g
        found = _bisect(g, cfg.hardware.nodes, planner, checked=False)
        if found is not None:
            return found
        start = g      # greedy fits at g but the planner's plan does not (its DPP sizing): search above
    elif greedy_only:
        return None
    else:
        start = cfg.hardware.nodes
    bracket = _doubling(start, planner)
    return None if bracket is None else _bisect(bracket[1], bracket[0], planner, checked=True)


def largest_batch(cfg: NeocfgConfig, probe: Prober) -> Optional[int]:
    """Largest train.batch_size (below the current one) with which the configured planner fits cfg, planned by it;
    None if not even 1 does. Greedy's largest batch fits the planner too: it is bisected above it."""
    def planner(b: int) -> bool:
        return probe.fits(with_batch(cfg, b), f"train.batch_size={b:,}")

    if not probe.greedy_fits(with_batch(cfg, 1)):
        return None
    g = _bisect(1, cfg.train.batch_size, lambda b: probe.greedy_fits(with_batch(cfg, b)), checked=True)
    if cfg.planner.algorithm is PlannerAlgorithm.greedy or g is None:
        return g
    found = _bisect(g, cfg.train.batch_size, planner, checked=False)
    return found if found is not None else _bisect(1, g, planner, checked=False)


def _fp16(cfg: NeocfgConfig) -> Optional[Change]:
    if WeightsDtype.fp16 in cfg.planner.weights_dtypes:
        return None
    dtypes = [*cfg.planner.weights_dtypes, WeightsDtype.fp16]
    return Change(f"fp16 weights (planner.weights_dtypes=[{','.join(d.value for d in dtypes)}])",
                  _with_planner(cfg, weights_dtypes=dtypes))


def _unrestricted(cfg: NeocfgConfig) -> list[Change]:
    """The planner's own restrictions lifted (memory tiers, sharding types), where the config narrowed them."""
    out = []
    if set(cfg.planner.memory_tiers) != set(MemoryTier):
        out.append(Change(f"planner.memory_tiers=[{','.join(t.value for t in MemoryTier)}]",
                          _with_planner(cfg, memory_tiers=list(MemoryTier))))
    if set(cfg.planner.sharding_types) != set(ShardingType):
        out.append(Change(f"planner.sharding_types=[{','.join(s.value for s in ShardingType)}]",
                          _with_planner(cfg, sharding_types=list(ShardingType))))
    return out


def verified_changes(cfg: NeocfgConfig, probe: Prober) -> tuple[list[str], bool]:
    """The changes that make cfg fit, each verified by planning; and whether the batch size is what does not fit
    (a smaller batch fits while neither more nodes nor lighter weights do). Appends to `found` as it goes, so that
    what was verified before the budget ran out (_OutOfTime) is kept."""
    found: list[str] = []
    try:
        for change in (c for c in (_fp16(cfg), *_unrestricted(cfg)) if c is not None):
            if probe.fits(change.cfg, change.text):
                found.append(change.text)
        nodes = smallest_nodes(cfg, probe)
        if nodes is not None:
            found.append(f"hardware.nodes>={nodes}")
        fp16 = _fp16(cfg)
        if fp16 is not None and fp16.text not in found:
            nodes16 = smallest_nodes(fp16.cfg, probe)
            if nodes16 is not None and (nodes is None or nodes16 < nodes):
                found.append(f"{fp16.text} with hardware.nodes>={nodes16}")
        if found or cfg.train.batch_size <= 1:
            return found, False
        batch = largest_batch(cfg, probe)
    except _OutOfTime:
        return found, False
    return ([f"train.batch_size<={batch:,}"], True) if batch is not None else ([], False)


def advise(cfg: NeocfgConfig, exc: InfeasibleError, budget_s: float = ADVICE_BUDGET_S) -> InfeasibleError:
    """The planner's reason with verified changes in place of its guesses."""
    reason = _SUGGESTION.sub("", str(exc))
    probe = Prober(time.perf_counter() + budget_s, report=True)
    with planning_progress(cfg, "checking which changes make it fit"):
        found, batch_bound = verified_changes(cfg, probe)
    stopped = time.perf_counter() > probe.deadline
    if batch_bound and isinstance(exc, IngestLimitError):   # a smaller batch slows the nodes' intake; no buffers
        return InfeasibleError(f"{reason}; verified to fit: {found[-1]}")
    if batch_bound:
        # Nothing but the batch size helps: the batch is the problem, not whichever table the planner met first.
        return InfeasibleError(
            f"model {cfg.model.name} does not fit {cfg.hardware.name} at train.batch_size={cfg.train.batch_size:,}"
            f" (per device): the per-batch buffers leave no room, whatever the nodes or weights precision; verified"
            f" to fit: {found[-1]}")
    if not found:
        if stopped:
            return InfeasibleError(f"{reason}; no change was verified to fit within {budget_s:.0f} s of checking"
                                   f" (fp16 weights, more nodes, a smaller batch: plan them to see)")
        tried = ["fp16 weights", f"up to {MAX_NODES:,} nodes"]
        if cfg.train.batch_size > 1:
            tried.append("a smaller train.batch_size")
        return InfeasibleError(f"{reason}; no change neocfg tried makes it fit ({', '.join(tried)})")
    more = f" (checking stopped after {budget_s:.0f} s: smaller changes may fit too)" if stopped else ""
    return InfeasibleError(f"{reason}; verified to fit: {' or '.join(found)}{more}")


@contextlib.contextmanager
def planning_progress(cfg: NeocfgConfig, what: str = "") -> Iterator[None]:
    """A line on stderr every PROGRESS_EVERY_S seconds while the body runs."""
    every = float(os.environ.get("NEOCFG_PROGRESS_EVERY_S", PROGRESS_EVERY_S))
    done = threading.Event()
    t0 = time.perf_counter()
    pl = cfg.planner
    doing = what or (f"{pl.algorithm.value} still solving" + (f" (stops by planner.time_limit_s={pl.time_limit_s:g})"
                                                              if pl.algorithm is PlannerAlgorithm.ilp else ""))

    def tick() -> None:
        while not done.wait(every):
            print(f"planning {cfg.model.name} on {cfg.hardware.name}: {doing}, {time.perf_counter() - t0:.0f} s so"
                  f" far", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="neocfg-planning-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def advising(cfg: NeocfgConfig) -> Iterator[None]:
    """Planning inside: progress while it runs; an InfeasibleError leaves with verified advice."""
    try:
        with planning_progress(cfg):
            yield
    except InfeasibleError as exc:
        raise advise(cfg, exc) from exc


def plan_or_advise(cfg: NeocfgConfig) -> Plan:
    from neocfg.planner import make_plan

    with advising(cfg):
        return make_plan(cfg)
