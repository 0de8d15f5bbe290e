"""Lower bounds on the busiest device's embedding time (ms) that hold for every plan (before the dense part).

Per table t: u_t = the least time a uniform option (row-wise, data-parallel: every device) adds to every device,
q_t = the least time one piece of a placed option (table-wise, column/row slices of one node...) adds to its device,
w_t = the least total work of any option.
  average      every plan does >= sum_t w_t of work over W devices
  piece        the table with the largest min(q_t, u_t) puts at least that on some device
  cardinality  if n - k tables are placed as pieces over W devices, some device holds ceil((n - k)/W) pieces of
               distinct tables (>= the sum of that many smallest q), and the k tables made uniform add >= the k
               smallest u to every device; minimized over k.
Under output_overlap each is less the most any device hides (hiding.py).
"""

from __future__ import annotations

import math
from typing import Sequence

from neocfg.planner.fixed import FixedCosts
from neocfg.planner.hiding import NO_HIDING, Hiding
from neocfg.planner.types import ShardingOption, Topology


def lower_bound(topo: Topology, options: Sequence[Sequence[ShardingOption]], fixed: FixedCosts,
                hiding: Hiding = NO_HIDING) -> float:
    """A bound on the busiest device's embedding time, fixed costs included: the pieces' bounds below bound the
    pieces' time of the busiest device; that device holds at least one lookup group, and every device pays the
    plan-wide fixed costs (FixedCosts.minimum). Where the bottom MLP hides part of the outputs' all-to-all
    (hiding.py), no device hides more than the most any device can (Hiding.most): the busiest device's time is at
    least the bound without it less that."""
    return max(0.0, simple_lower_bound(topo, options) + fixed.minimum(options) - hiding.most(options))


def simple_lower_bound(topo: Topology, options: Sequence[Sequence[ShardingOption]]) -> float:
    """A bound on the largest time the pieces alone (fixed costs left out) put on one device."""
    w = topo.world
    average = sum(min(o.total_work for o in opts) for opts in options) / w
    inf = math.inf
    u = [min((o.perf.total for o in opts if o.is_uniform), default=inf) for opts in options]
    q = [min((o.perf.total for o in opts if not o.is_uniform), default=inf) for opts in options]
    piece = max(min(a, b) for a, b in zip(u, q))
    return max(average, piece, cardinality_bound(w, u, q))


def cardinality_bound(world: int, u: Sequence[float], q: Sequence[float]) -> float:
    n = len(u)
    must_uniform = sum(1 for x in q if x == math.inf)
    must_piece = sum(1 for x in u if x == math.inf)
    qs = sorted(x for x in q if x != math.inf)
    us = sorted(x for x in u if x != math.inf)
    q_prefix = [0.0]
    for x in qs:
        q_prefix.append(q_prefix[-1] + x)
    u_prefix = [0.0]
    for x in us:
        u_prefix.append(u_prefix[-1] + x)
    best = math.inf
    for k in range(must_uniform, n - must_piece + 1):   # k tables uniform, n - k placed as pieces
        m = math.ceil((n - k) / world)
        if k > len(us) or m > len(qs):
            continue
        best = min(best, u_prefix[k] + q_prefix[m])
    return 0.0 if best == math.inf else best
