"""Lower bounds on the busiest device's embedding time (ms) that hold for every plan (before the dense part)."""

from __future__ import annotations

from typing import Sequence

from neocfg.planner.types import ShardingOption, Topology


def simple_lower_bound(topo: Topology, options: Sequence[Sequence[ShardingOption]]) -> float:
    """max(per-device average of every table's cheapest option, the largest unavoidable single piece)."""
    w = topo.world
    average = sum(min(o.total_work for o in opts) for opts in options) / w
    # Uniform work every plan pays on every device, plus the least any table must put on one device.
    base = sum(min(o.perf.total if o.is_uniform else 0.0 for o in opts) for opts in options)
    piece = max(min(o.perf.total if not o.is_uniform else 0.0 for o in opts) for opts in options)
    return max(average, base + piece)
