"""The ILP planner (PuLP + bundled CBC): exact for small instances, decomposed for large ones.

Small instances (at most `planner.exact_max_variables` placement variables) are solved as one flat model
(ilp_flat.py); with gap 0 that is exactly optimal. Large ones use the structure (identical devices, symmetric nodes):
the aggregated model (ilp_aggregate.py) chooses the options and proves the bound, then the chosen pieces are placed
largest first (by work, and by memory) onto the least-loaded devices and improved by moves and swaps
(improve.py). The greedy plan warm-starts both models and is kept when no ILP plan is better (placement_source
says which was kept). Both models carry the fixed costs (fixed.py), so the reported bound, the larger of the
solver's and the combinatorial bounds (bounds.py), holds for every plan of the enumerated options; the gap is that
of the step time (dense part included).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import InfeasibleError
from neocfg.planner.bounds import lower_bound
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.fixed import FixedCosts
from neocfg.planner.greedy import greedy_place, greedy_with_fallback
from neocfg.planner.ilp_aggregate import solve_aggregate
from neocfg.planner.ilp_flat import solve_flat
from neocfg.planner.ilp_problem import MIN_SOLVE_S, IlpProblem, Options
from neocfg.planner.improve import improve
from neocfg.planner.types import Placement, PlacementSource, ShardingOption, SolveResult, Spread, Topology

# (fraction of the memory capacity the aggregated model may use, largest piece share), tried in turn when placing
# the chosen pieces runs into fragmentation (the aggregate only knows total memory). With a piece share < 1, options
# whose piece needs more than that share of a device's memory are left out (smaller pieces pack; the last resort of
# memory-tight models).
AGGREGATE_STEPS = ((1.0, 1.0), (0.97, 1.0), (0.9, 1.0), (0.9, 0.5), (0.85, 0.25))
# A gap below this is the solvers' tolerance (cbc.SOLVER_BOUND_SLACK), reported as optimal.
OPTIMAL_GAP = 1e-4
# Up to this many tables the warm start also tries one greedy plan per collective group (a few ms per table each).
KIND_WARM_STARTS_MAX_TABLES = 1000
# Time kept for placing the aggregate's choice, as a multiple of what the warm start (greedy + local search) took:
# placing runs two greedy passes over one option per table and the local search; CBC overshoots its limit too.
PLACEMENT_RESERVE = 1.0


def placement_variables(topo: Topology, options: Options) -> int:
    """Placement decisions of the flat model (decides flat vs decomposed)."""
    per = {Spread.one: topo.world, Spread.distinct: topo.world, Spread.node_distinct: topo.world + topo.nodes,
           Spread.node: topo.nodes, Spread.world: 1}
    return sum(1 if o.fixed_ranks is not None else per[o.spread] for opts in options for o in opts)


def _small_pieces(p: IlpProblem, share: float) -> list[list[ShardingOption]]:
    def fraction(o: ShardingOption) -> float:
        return max(o.storage.hbm / max(p.capacity.hbm, 1), o.storage.host / max(p.capacity.host, 1))

    return [[o for o in opts if fraction(o) <= share] or [min(opts, key=fraction)] for opts in p.options]


def place_chosen(p: IlpProblem, picked: Sequence[ShardingOption]) -> Optional[list[Placement]]:
    """Place the chosen options: largest work first and largest memory first, each improved; the better one."""
    single = [[o] for o in picked]
    found = []
    for by_memory in (False, True):
        try:
            placed = list(greedy_place(p.topo, p.capacity, single, p.names, by_memory=by_memory))
        except InfeasibleError:
            continue
        found.append(improve(p.topo, p.capacity, placed))
    return min(found, key=p.makespan) if found else None


def solve_decomposed(p: IlpProblem, warm: Optional[Sequence[Placement]],
                     deadline: float) -> tuple[Optional[list[Placement]], float, str]:
    bound, status = 0.0, "not_solved"
    for scale, share in AGGREGATE_STEPS:
        left = deadline - time.perf_counter()
        if left < MIN_SOLVE_S:
            break
        # With a warm start in hand, building the model counts against the deadline; without one (memory-tight
        # models, where greedy found no room) the solver gets all the time left once the model is built.
        timing = dict(deadline=deadline) if warm is not None else dict(time_limit_s=left)
        restricted = dataclasses.replace(p, **timing, options=p.options if share >= 1.0 else _small_pieces(p, share))
        picked, b, st = solve_aggregate(restricted, warm if share >= 1.0 else None, scale)
        if scale >= 1.0 and share >= 1.0:
            bound, status = b, st
            if b == float("inf"):
                return None, b, "infeasible"
        placed = place_chosen(p, picked) if picked is not None else None
        if placed is not None:
            return placed, bound, status
    return None, bound, status


def _no_placement(cfg: NeocfgConfig, p: IlpProblem, status: str) -> str:
    w = p.topo.world
    need = sum(min((o.storage.hbm + o.storage.host) * o.num_pieces for o in opts) for opts in p.options)
    have = (p.capacity.hbm + p.capacity.host) * w
    gib = 1024**3
    verdict = "proved that none exists" if status == "infeasible" else "found none within planner.time_limit_s"
    return (f"no placement of {cfg.model.name} on {cfg.hardware.name} fits every device's memory (the solver"
            f" {verdict}): the tables need at least {need / gib:,.0f} GiB of HBM + host DDR of the"
            f" {have / gib:,.0f} GiB usable, in pieces too large to pack; would fit with fp16 weights, UVM caching,"
            f" row-wise sharding or hardware.nodes>={cfg.hardware.nodes + max(1, cfg.hardware.nodes // 4)}")


def _greedy_improved(p: IlpProblem, options: Options) -> Optional[list[Placement]]:
    try:
        return improve(p.topo, p.capacity, list(greedy_with_fallback(p.topo, p.capacity, options, p.names)))
    except InfeasibleError:
        return None


def warm_start(p: IlpProblem) -> Optional[list[Placement]]:
    """The greedy plan improved by local search; up to KIND_WARM_STARTS_MAX_TABLES tables also greedy plans that
    keep to one collective group (every table that has an option of it), which pay one group's latency: the best.
    (Greedy weighs each table alone and so never sees that leaving a kind out saves its collectives.)"""
    found = [_greedy_improved(p, p.options)]
    if len(p.options) <= KIND_WARM_STARTS_MAX_TABLES:
        for kinds, ms in p.fixed.kinds:
            if ms > 0:
                found.append(_greedy_improved(p, [[o for o in opts if o.sharding in kinds] or list(opts)
                                                  for opts in p.options]))
    found = [f for f in found if f is not None]
    return min(found, key=p.makespan) if found else None


def solve_ilp(cfg: NeocfgConfig, cost: CostModel, options: Options) -> SolveResult:
    t0 = time.perf_counter()
    pl = cfg.planner
    p = IlpProblem(topo=cost.topo, capacity=cost.capacity, options=options,
                   names=tuple(t.name for t in cfg.model.tables), time_limit_s=pl.time_limit_s, gap=pl.mip_gap,
                   tiebreak=pl.costs.comm_tiebreak, offset_ms=dense_cost(cfg).perf.total,
                   fixed=FixedCosts.of(cost), solver=pl.solver)
    t_warm = time.perf_counter()
    warm = warm_start(p)
    warm_s = time.perf_counter() - t_warm
    flat = placement_variables(p.topo, options) <= pl.exact_max_variables
    if flat:
        found, bound, status = solve_flat(dataclasses.replace(p, deadline=t0 + pl.time_limit_s), warm)
    else:
        found, bound, status = solve_decomposed(p, warm, t0 + pl.time_limit_s - PLACEMENT_RESERVE * warm_s)
    solved = PlacementSource.ilp if flat else PlacementSource.ilp_choice
    # the warm start first: it is kept unless an ILP plan is strictly better
    candidates = [(c, src) for c, src in ((warm, PlacementSource.warm_start), (found, solved)) if c is not None]
    if not candidates:
        raise InfeasibleError(_no_placement(cfg, p, status))
    best, source = min(candidates, key=lambda cs: p.makespan(cs[0]))
    makespan = p.makespan(best)
    bound = max(bound if bound != float("inf") else 0.0, lower_bound(p.topo, options, p.fixed))
    gap = (makespan - bound) / (makespan + p.offset_ms) if makespan + p.offset_ms > 0 else 0.0
    final = ("optimal" if gap <= OPTIMAL_GAP else "within_gap" if gap <= pl.mip_gap
             else "time_limit" if status == "feasible" else "feasible")
    return SolveResult(placements=tuple(best), algorithm="ilp" if flat else "ilp (decomposed)", status=final,
                       seconds=time.perf_counter() - t0, lower_bound_ms=bound, placement_source=source)
