"""The greedy planner (TorchRec-style): tables largest first; for each, the option whose pieces, put on the
least-loaded devices with memory room, give the smallest projected step time (the larger of the new busiest device
and the new per-device average including a lower estimate of the tables still to come). Also the ILP's warm start.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from neocfg.errors import InfeasibleError
from neocfg.planner.bounds import simple_lower_bound
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, SolveResult, Storage, Topology


def greedy_place(topo: Topology, capacity: Storage, options: Sequence[Sequence[ShardingOption]],
                 names: Sequence[str]) -> tuple[Placement, ...]:
    """One placement per table (table order); raises InfeasibleError naming the first table that finds no room."""
    w = topo.world
    min_work = [min(o.total_work for o in opts) for opts in options]
    order = sorted(range(len(options)), key=lambda t: (options[t][0].fixed_ranks is None, -min_work[t]))
    remaining = sum(min_work)
    loads = DeviceLoads(topo, capacity)
    chosen: list[Optional[Placement]] = [None] * len(options)
    for t in order:
        remaining -= min_work[t]
        best: Optional[tuple[tuple[float, float], Placement]] = None
        peak, total = float(loads.time.max()), float(loads.time.sum())
        for o in options[t]:
            ranks = loads.best_ranks(o)
            if ranks is None:
                continue
            new_peak = max(peak, float(loads.time[list(ranks)].max()) + o.perf.total)
            projected = max(new_peak, (total + o.total_work + remaining) / w)
            key = (projected, o.total_work)
            if best is None or key < best[0]:
                best = (key, Placement(o, ranks))
        if best is None:
            raise InfeasibleError(_no_room(names[t], options[t], loads))
        loads.add(best[1])
        chosen[t] = best[1]
    return tuple(p for p in chosen if p is not None)


def _no_room(name: str, opts: Sequence[ShardingOption], loads: DeviceLoads) -> str:
    o = min(opts, key=lambda o: o.storage.hbm + o.storage.host)
    free_hbm = int((loads.capacity.hbm - loads.hbm).max())
    free_host = int((loads.capacity.host - loads.host).max())
    gib = 1024**3
    return (f"table {name} finds no device with room after the larger tables were placed: its smallest option"
            f" {o.label()} needs {o.storage.hbm / gib:,.2f} GiB HBM + {o.storage.host / gib:,.2f} GiB host per"
            f" device, the freest device has {free_hbm / gib:,.2f} GiB HBM / {free_host / gib:,.2f} GiB host left;"
            f" would fit with fp16 weights, UVM caching, row-wise sharding or more nodes")


def solve_greedy(topo: Topology, capacity: Storage, options: Sequence[Sequence[ShardingOption]],
                 names: Sequence[str]) -> SolveResult:
    t0 = time.perf_counter()
    placements = greedy_place(topo, capacity, options, names)
    return SolveResult(placements=placements, algorithm="greedy", status="heuristic",
                       seconds=time.perf_counter() - t0, lower_bound_ms=simple_lower_bound(topo, options))
