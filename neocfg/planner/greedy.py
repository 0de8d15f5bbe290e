"""The greedy planner (TorchRec-style): tables largest first; for each, the option whose pieces, put on the
least-loaded devices with memory room, give the smallest projected step time (the larger of the new busiest device
and the new per-device average including a lower estimate of the tables still to come). Also the ILP's warm start.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional, Sequence

import numpy as np

from neocfg.errors import InfeasibleError
from neocfg.planner.bounds import lower_bound
from neocfg.planner.fixed import FixedCosts
from neocfg.planner.hiding import NO_HIDING, Hiding
from neocfg.planner.loads import DeviceLoads, Peak
from neocfg.planner.types import Placement, PlacementSource, ShardingOption, SolveResult, Storage, Topology


def greedy_place(topo: Topology, capacity: Storage, options: Sequence[Sequence[ShardingOption]],
                 names: Sequence[str], by_memory: bool = False) -> tuple[Placement, ...]:
    """One placement per table (table order); raises InfeasibleError naming the first table that finds no room.

    Tables go largest first (after those with forced ranks and those that can only be uniform): by work, or with by_memory by the largest fraction of a device's memory a piece needs
    (first-fit-decreasing, for plans where memory rather than time is tight)."""
    w = topo.world
    min_work = [min(o.total_work for o in opts) for opts in options]

    def memory_share(t: int) -> float:
        return min(max(o.storage.hbm / max(capacity.hbm, 1), o.storage.host / max(capacity.host, 1))
                   for o in options[t])

    size = memory_share if by_memory else (lambda t: min_work[t])
    # forced ranks first, then tables that can only go on every device (row-wise / data-parallel: they need room on
    # all of them, which the others would use up), then largest first
    order = sorted(range(len(options)), key=lambda t: (options[t][0].fixed_ranks is None,
                                                       not all(o.is_uniform for o in options[t]), -size(t)))
    remaining = sum(min_work)
    # Memory the tables still to come need at least (per tier, summed over devices): an option that would leave
    # less than that is taken only when nothing else fits.
    min_hbm = [min(o.storage.hbm * o.num_pieces for o in opts) for opts in options]
    min_host = [min(o.storage.host * o.num_pieces for o in opts) for opts in options]
    rem_hbm, rem_host = sum(min_hbm), sum(min_host)
    total_hbm, total_host = capacity.hbm * w, capacity.host * w
    loads = DeviceLoads(topo, capacity)
    chosen: list[Optional[Placement]] = [None] * len(options)
    for t in order:
        remaining -= min_work[t]
        rem_hbm -= min_hbm[t]
        rem_host -= min_host[t]
        used_hbm, used_host = int(loads.hbm.sum()), int(loads.host.sum())
        best: Optional[tuple[tuple[bool, float, float], Placement]] = None
        peak, total = float(loads.time.max()), float(loads.time.sum())
        for o, ranks, at in _candidates(loads, options[t]):
            new_peak = max(peak, at.time + o.perf.total)
            projected = max(new_peak, (total + o.total_work + remaining) / w)
            starves = (used_hbm + o.storage.hbm * o.num_pieces + rem_hbm > total_hbm
                       or used_host + o.storage.host * o.num_pieces + rem_host > total_host
                       or at.hbm + o.storage.hbm > capacity.hbm - rem_hbm / w
                       or at.host + o.storage.host > capacity.host - rem_host / w)
            key = (starves, projected, o.total_work)
            if best is None or key < best[0]:
                best = (key, Placement(o, ranks))
        if best is None:
            raise InfeasibleError(_no_room(names[t], options[t], loads))
        loads.add(best[1])
        chosen[t] = best[1]
    return tuple(p for p in chosen if p is not None)


def _candidates(loads: DeviceLoads, opts: Sequence[ShardingOption]) -> Iterator[tuple[ShardingOption, tuple[int, ...],
                                                                                     Peak]]:
    """Each option that can be placed now, the least-loaded ranks with room for it and their largest loads. Options of
    one placement shape whose memory sizes leave the same devices with room share those ranks (found once)."""
    shapes: dict[tuple, list[ShardingOption]] = {}
    for o in opts:
        shapes.setdefault((o.spread, o.num_pieces, o.fixed_ranks), []).append(o)
    for group in shapes.values():
        small = loads.room(min(o.storage.hbm for o in group), min(o.storage.host for o in group))
        large = loads.room(max(o.storage.hbm for o in group), max(o.storage.host for o in group))
        if np.array_equal(small, large):
            ranks = loads.best_ranks(group[0], small)
            if ranks is None:
                continue
            at = loads.peak(ranks)
            yield from ((o, ranks, at) for o in group)
            continue
        for o in group:
            ranks = loads.best_ranks(o)
            if ranks is not None:
                yield o, ranks, loads.peak(ranks)


def _no_room(name: str, opts: Sequence[ShardingOption], loads: DeviceLoads) -> str:
    gib = 1024**3
    o = min(opts, key=lambda o: (o.storage.hbm + o.storage.host) * o.num_pieces)
    with_room = int(loads.fits_mask(o).sum())
    return (f"table {name} finds no room after the larger tables were placed: its smallest option {o.label()} needs"
            f" {o.storage.hbm / gib:,.3f} GiB device memory + {o.storage.host / gib:,.3f} GiB host DDR on each of"
            f" {o.num_pieces} device(s), {with_room} of {loads.topo.world} devices have that much left; would fit"
            f" with planner.algorithm=ilp, fp16 weights, UVM caching, row-wise sharding or more nodes")


def _placed_first(options: Sequence[Sequence[ShardingOption]]) -> list[list[ShardingOption]]:
    """Each table's options without the uniform ones (row-wise, data-parallel) where it has others."""
    return [[o for o in opts if not o.is_uniform] or list(opts) for opts in options]


def greedy_with_fallback(topo: Topology, capacity: Storage, options: Sequence[Sequence[ShardingOption]],
                         names: Sequence[str]) -> tuple[Placement, ...]:
    """The best of a few greedy passes: largest work first over all options, and over placed options only (the
    one-table-at-a-time choice undervalues how uniform options add up on every device); largest memory first
    when those run out of room. Raises the first pass's InfeasibleError when none finds room."""
    found: list[tuple[Placement, ...]] = []
    first_error: Optional[InfeasibleError] = None
    for opts, by_memory in ((options, False), (_placed_first(options), False), (options, True)):
        if by_memory and found:
            break
        try:
            found.append(greedy_place(topo, capacity, opts, names, by_memory=by_memory))
        except InfeasibleError as exc:
            first_error = first_error or exc
    if not found:
        assert first_error is not None
        raise first_error
    return min(found, key=lambda pl: float(DeviceLoads.of(topo, capacity, pl).time.max()))


def solve_greedy(topo: Topology, capacity: Storage, options: Sequence[Sequence[ShardingOption]],
                 names: Sequence[str], fixed: FixedCosts, hiding: Hiding = NO_HIDING) -> SolveResult:
    t0 = time.perf_counter()
    placements = greedy_with_fallback(topo, capacity, options, names)
    return SolveResult(placements=placements, algorithm="greedy", status="heuristic",
                       seconds=time.perf_counter() - t0, lower_bound_ms=lower_bound(topo, options, fixed, hiding),
                       placement_source=PlacementSource.greedy)
