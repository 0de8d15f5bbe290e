"""Advice that has been checked: when planning fails, the message names only changes that the planner has verified
to make the plan fit, and of each kind the smallest (fewest nodes, largest batch).

The planner's stages explain *why* a model does not fit (a table too large for a device, the cluster's total
memory, the trainer's ingest limit); their own suggestions are first guesses. `plan_or_advise` keeps the reason,
replaces the guesses with verified changes, and says so when no change it tries helps. Every candidate is planned
for real with the greedy algorithm (a greedy placement that fits proves the change works; the ILP starts from the
same greedy placement, so it finds one too).

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
# Seconds spent verifying changes after a failed plan: every probe is a real (greedy) plan, which takes seconds on
# an 856-table model; past this the message gives what has been verified so far and says that it stopped.
ADVICE_BUDGET_S = 60.0
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
    """Whether the planner finds a placement (and a DPP sizing) for cfg: a real plan, not an estimate."""
    from neocfg.planner import make_plan

    try:
        make_plan(_greedy(cfg))
    except NeocfgError:
        return False
    return True


class _OutOfTime(Exception):
    pass


@dataclass(frozen=True)
class Prober:
    """`fits` with a deadline: raises _OutOfTime once the advice budget is spent."""

    deadline: float

    def fits(self, cfg: NeocfgConfig) -> bool:
        if time.perf_counter() > self.deadline:
            raise _OutOfTime
        return fits(cfg)


def with_nodes(cfg: NeocfgConfig, nodes: int) -> NeocfgConfig:
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, nodes=nodes, world_size=None))


def with_batch(cfg: NeocfgConfig, batch: int) -> NeocfgConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch))


def _with_planner(cfg: NeocfgConfig, **kw: object) -> NeocfgConfig:
    return dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, **kw))


def _boundary(good: int, bad: int, ok: Callable[[int], bool]) -> int:
    """Bisect between a value that works (`good`) and one that does not (`bad`): the last one that works."""
    while abs(bad - good) > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def smallest_nodes(cfg: NeocfgConfig, probe: Prober) -> Optional[int]:
    """Fewest nodes (more than now, at most MAX_NODES) with which cfg fits: doubling, then bisection; the
    answer itself has been planned."""
    n = lo = cfg.hardware.nodes
    while n < MAX_NODES:
        n = min(MAX_NODES, n * 2)
        if probe.fits(with_nodes(cfg, n)):
            return _boundary(n, lo, lambda m: probe.fits(with_nodes(cfg, m)))
        lo = n
    return None


def largest_batch(cfg: NeocfgConfig, probe: Prober) -> Optional[int]:
    """Largest train.batch_size (below the current one) with which cfg fits; None if not even 1 does."""
    if not probe.fits(with_batch(cfg, 1)):
        return None
    return _boundary(1, cfg.train.batch_size, lambda b: probe.fits(with_batch(cfg, b)))


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
            if probe.fits(change.cfg):
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
    probe = Prober(time.perf_counter() + budget_s)
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
