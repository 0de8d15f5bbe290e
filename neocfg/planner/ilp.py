"""The ILP planner (PuLP + bundled CBC, or HiGHS): exact for small instances, decomposed for large ones.

Small instances (at most `planner.exact_max_variables` placement variables) are solved as one flat model
(ilp_flat.py); with gap 0 that is exactly optimal. The aggregated MIP (ilp_aggregate.py) runs first on them (it closes
in a fraction of a second): the exact model starts from its bound, so it stops once a plan is within planner.mip_gap
of it instead of proving the bound over many alike placements, and is skipped when a plan already is. Large ones
use the structure (identical devices, symmetric nodes): the aggregated model chooses the options and proves the
bound, first as its LP relaxation (seconds, where the MIP on thousands of tables finds no solution in minutes; its
solution is mostly integral: each table's option of the largest value is kept), then, where that choice fills the
devices' memory so full that it does not pack, again with less memory per device, then as the MIP if the gap is still
open; each choice is placed largest first (by work, and by memory) onto the least-loaded devices and improved by
moves and swaps (improve.py). The greedy plan warm-starts the models and is kept when no other plan is better
(placement_source says which was kept). While the best plan is not within planner.mip_gap of the bound, the time left
goes to switching the options of the busiest device's tables in each plan found (switch_options). Every phase,
enumerating the options included, shares planner.time_limit_s; only while no plan is in hand may a solver run past
it (MIN_SOLVE_SHARE). Both models carry the fixed costs (fixed.py), so the reported bound, the
larger of the solvers' and the combinatorial bounds (bounds.py), holds for every plan of the enumerated options; the
gap is that of the step time (dense part included).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import InfeasibleError
from neocfg.planner.bounds import lower_bound
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.fixed import FixedCosts
from neocfg.planner.greedy import greedy_place, greedy_with_fallback
from neocfg.planner.hiding import Hiding
from neocfg.planner.ilp_aggregate import AggregateModel
from neocfg.planner.ilp_flat import solve_flat
from neocfg.planner.ilp_problem import MIN_SOLVE_S, IlpProblem, Options, run_model
from neocfg.planner.improve import improve
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, PlacementSource, ShardingOption, SolveResult, Spread, Topology

# (fraction of the memory capacity the aggregated model may use, largest piece share), tried in turn when placing
# the chosen pieces runs into fragmentation (the aggregate only knows total memory). With a piece share < 1, options
# whose piece needs more than that share of a device's memory are left out (smaller pieces pack; the last resort of
# memory-tight models).
AGGREGATE_STEPS = ((1.0, 1.0), (0.9, 1.0), (0.9, 0.5), (0.85, 0.25))
# A full-model choice whose pieces take more than this share of all devices' memory (either tier) may not pack: while
# the gap is open, the next of AGGREGATE_STEPS is tried. prod_4096 x 128: the full model's choice fills 99.8% of HBM
# and places at 2x its bound (embedding part), at 95% of the memory 1.2x, at 90% within 0.3%.
PACKING_FILL = 0.95
# A gap below this is the solvers' tolerance (cbc.SOLVER_BOUND_SLACK), reported as optimal.
OPTIMAL_GAP = 1e-4
# Up to this many tables the warm start also tries one greedy plan per collective group (a few ms per table each).
KIND_WARM_STARTS_MAX_TABLES = 1000
# Time kept for placing the aggregate's choice, as a multiple of what the warm start (greedy + local search) took:
# placing runs two greedy passes over one option per table and the local search; CBC overshoots its limit too.
PLACEMENT_RESERVE = 1.0
# The aggregated MIP's own relative gap as a share of planner.mip_gap: its optimum lies below what placing its choice
# gives, so a bound proven only to mip_gap of its incumbent leaves the plan's gap above mip_gap (dcnv2_mlperf x 128:
# 1.67% at 1, 1.42% at 0.1, in 0.2 s more).
AGGREGATE_GAP_SHARE = 0.1
# Share of planner.time_limit_s the aggregated MIP may take before the exact model on small instances.
AGGREGATE_SHARE = 0.25
# The exact model runs in slices of this share of planner.time_limit_s; a slice that finds no better plan than the one
# it was started from ends it. dcnv2_mlperf x 8 and x 16 under the drop-in's TorchRec estimator (gap 1e-4) and neocfg's
# own x 16 without column slices ran the whole 45 s limit in one run, and found no plan as good as switching options
# on the aggregate's choice gives in 2 s.
EXACT_SLICE_SHARE = 0.1
# switch_options keeps a change of option only when it lowers the makespan by at least this share (float noise, and
# no endless run of negligible gains on thousands of tables).
SWITCH_MIN_GAIN = 1e-6


def placement_variables(topo: Topology, options: Options) -> int:
    """Placement decisions of the flat model (decides flat vs decomposed)."""
    per = {Spread.one: topo.world, Spread.distinct: topo.world, Spread.node_distinct: topo.world + topo.nodes,
           Spread.node: topo.nodes, Spread.world: 1}
    return sum(1 if o.fixed_ranks is not None else per[o.spread] for opts in options for o in opts)


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


@dataclass
class Found:
    """What the decomposition hands back: the plans it placed (with their source), the proven bound on the makespan
    and the solver's status."""

    plans: list[tuple[list[Placement], PlacementSource]] = field(default_factory=list)
    bound: float = 0.0
    status: str = "not_solved"


def gap_of(p: IlpProblem, makespan: float, bound: float) -> float:
    """Relative gap of the step time (the dense part is in both)."""
    return (makespan - bound) / (makespan + p.offset_ms) if makespan + p.offset_ms > 0 else 0.0


def solve_decomposed(p: IlpProblem, warm: Optional[Sequence[Placement]], deadline: float) -> Found:
    """The aggregated model, first as its LP relaxation (a bound in seconds where the MIP takes minutes on thousands of
    tables, and a choice: each table's option of the largest value, placed), then, unless the best plan so far is
    already within planner.mip_gap of the bound, as the MIP until the deadline, warm-started with that plan.

    A choice that fills the devices' memory (more than PACKING_FILL of it) may not pack: its pieces land where there
    is room rather than where there is time. Then the relaxation is solved again with less memory per device and
    large pieces left out (AGGREGATE_STEPS, one model whose memory rows are rescaled) before the MIP gets the time
    left; only the full model's bounds count."""
    found = Found()
    best = list(warm) if warm is not None else None
    agg = dataclasses.replace(p, deadline=deadline, gap=p.gap * AGGREGATE_GAP_SHARE)
    model = AggregateModel(agg, p.most_capacity)

    def run(scale: float, share: float, relax: bool) -> bool:
        """Solve at this headroom and keep the plan its choice gives (a run of the full model raises the bound).
        Returns whether a next step may pack better: the choice found no room or filled the memory."""
        nonlocal best
        full = scale >= 1.0 and share >= 1.0
        model.set_headroom(scale, share)
        late = dataclasses.replace(agg, late_ok=best is None)
        out, weight = run_model(late, model, None if relax or not full else best, relax=relax)
        if full:
            # (a plan in hand proves the full model feasible: a solver stopped early may still say infeasible)
            if out.status == "infeasible" and best is None:
                found.bound, found.status = float("inf"), "infeasible"
                return False
            found.bound = max(found.bound, agg.bound_on_makespan(out.bound, weight))
            found.status = out.status
        if out.objective is None:
            return False
        picked = model.picked()
        placed = place_chosen(p, picked)
        if placed is not None:
            found.plans.append((placed, PlacementSource.lp_choice if relax else PlacementSource.ilp_choice))
            best = min([b for b in (best, placed) if b is not None], key=p.makespan)
        return placed is None or model.fill(picked) > PACKING_FILL

    step_s = 0.0   # what the first step took (solving and placing): no step starts with less time left

    def settled() -> bool:
        return found.bound == float("inf") or (
            best is not None and gap_of(p, p.makespan(best), max(found.bound, p.known_bound_ms)) <= p.gap)

    def time_left() -> bool:
        late = dataclasses.replace(agg, late_ok=best is None)
        return not late.out_of_time() and late.stop_at() - time.perf_counter() >= step_s

    if not time_left():
        return found
    t_step = time.perf_counter()
    tight = run(1.0, 1.0, relax=True)
    step_s = time.perf_counter() - t_step
    mip_done = False
    if not settled() and not tight and time_left():
        run(1.0, 1.0, relax=False)
        mip_done = True
    for scale, share in AGGREGATE_STEPS[1:]:
        if settled() or not tight or not time_left():
            break
        run(scale, share, relax=True)
    if not mip_done and not settled() and time_left():
        run(1.0, 1.0, relax=False)
    return found


def aggregate_bound(p: IlpProblem, warm: Optional[Sequence[Placement]]) -> tuple[float, Optional[list[Placement]]]:
    """The aggregated MIP on a small instance (it closes in well under a second): a proven bound on the makespan that
    the exact model starts from (the exact model's own bound rises slowly: identical devices make many plans alike),
    and its choice placed."""
    model = AggregateModel(p, p.most_capacity)
    out, weight = run_model(p, model, warm)
    if out.status == "infeasible":
        return float("inf"), None
    placed = place_chosen(p, model.picked()) if out.objective is not None else None
    return p.bound_on_makespan(out.bound, weight), placed


def solve_exact(p: IlpProblem, start: Optional[list[Placement]], bound: float,
                deadline: float) -> tuple[list[list[Placement]], float, str]:
    """The flat model in slices of EXACT_SLICE_SHARE of planner.time_limit_s, each warm-started with the best plan so
    far and starting from the best bound, until a plan is within planner.mip_gap of it, the search stalls (a slice
    finds no better plan, or found its best early in the slice: proving a tight gap over many alike devices can take
    minutes; the time left goes to switching options), or the deadline. While no plan is in hand, one run until the
    deadline. Returns the plans the model found, the bound and the last status ("stalled" where the search stalled)."""
    found: list[list[Placement]] = []
    best, status = start, "feasible"
    while True:
        stop = deadline if best is None else min(deadline, time.perf_counter() + max(
            MIN_SOLVE_S, EXACT_SLICE_SHARE * p.time_limit_s))
        exact = dataclasses.replace(p, deadline=stop, known_bound_ms=bound, late_ok=best is None)
        if exact.out_of_time():
            return found, bound, status
        placed, flat_bound, status = solve_flat(exact, best)
        bound = max(bound, flat_bound)
        better = placed is not None and (best is None or p.makespan(placed) < p.makespan(best) * (1 - SWITCH_MIN_GAIN))
        if placed is not None:
            found.append(placed)
        if not better:
            return found, bound, "stalled" if status == "feasible" else status
        if status != "feasible" or stop >= deadline:
            return found, bound, status
        best = placed


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


def warm_start(p: IlpProblem, deadline: float) -> Optional[list[Placement]]:
    """The greedy plan improved by local search; up to KIND_WARM_STARTS_MAX_TABLES tables also greedy plans that
    keep to one collective group (every table that has an option of it), which pay one group's latency: the best.
    (Greedy weighs each table alone and so never sees that leaving a kind out saves its collectives.)"""
    found = [_greedy_improved(p, p.options)]
    if len(p.options) <= KIND_WARM_STARTS_MAX_TABLES:
        for kinds, ms in p.fixed.kinds:
            if ms > 0 and time.perf_counter() < deadline:
                found.append(_greedy_improved(p, [[o for o in opts if o.sharding in kinds] or list(opts)
                                                  for opts in p.options]))
    found = [f for f in found if f is not None]
    return min(found, key=p.makespan) if found else None


def switch_options(p: IlpProblem, plan: Sequence[Placement], bound: float, deadline: float) -> list[Placement]:
    """Local search over the option choice: for each table with a piece on the busiest device (fixed costs included),
    each other option of it put on the least-loaded devices with room, the rest of the plan kept and improved by moves
    and swaps (improve.py); the first change that lowers the makespan is kept, until none does, the plan is within
    planner.mip_gap of `bound`, or the deadline. (The aggregate's choice placed as it is can be far from its own bound:
    a table whose chosen pieces land on loaded devices is better sliced otherwise.)"""
    best, best_ms = list(plan), p.makespan(plan)
    improved = True
    while improved and time.perf_counter() < deadline and gap_of(p, best_ms, bound) > p.gap:
        improved = False
        loads = DeviceLoads.of(p.topo, p.capacity, best)
        busiest = int(np.argmax(loads.time + p.fixed.device_times(p.topo, best)
                                - p.hiding.device_hidden(p.topo, best)))
        for t, pl in ((t, pl) for t, pl in enumerate(best) if busiest in pl.ranks and pl.option.fixed_ranks is None):
            for o in p.options[t]:
                if o is pl.option or time.perf_counter() > deadline:
                    continue
                loads.add(pl, sign=-1)
                ranks = loads.best_ranks(o)
                loads.add(pl)
                if ranks is None:
                    continue
                trial = improve(p.topo, p.capacity, [*best[:t], Placement(o, ranks), *best[t + 1:]])
                ms = p.makespan(trial)
                if ms < best_ms * (1 - SWITCH_MIN_GAIN):
                    best, best_ms, improved = trial, ms, True
                    break
            if improved:
                break
    return best


def solve_ilp(cfg: NeocfgConfig, cost: CostModel, options: Options, started: Optional[float] = None) -> SolveResult:
    """started: time.perf_counter() when planning began (the options enumerated before count against
    planner.time_limit_s, which every phase here shares: warm start, models, placing, switching options)."""
    t0 = time.perf_counter() if started is None else started
    pl = cfg.planner
    deadline = t0 + pl.time_limit_s
    p = IlpProblem(topo=cost.topo, capacity=cost.capacity, options=options,
                   names=tuple(t.name for t in cfg.model.tables), time_limit_s=pl.time_limit_s, gap=pl.mip_gap,
                   tiebreak=pl.costs.comm_tiebreak, offset_ms=dense_cost(cfg).perf.total,
                   fixed=FixedCosts.of(cost), solver=pl.solver, rank_capacity=cost.rank_capacity,
                   hiding=Hiding.of(cfg, cost, dense_cost(cfg)))
    p = dataclasses.replace(p, known_bound_ms=lower_bound(p.topo, options, p.fixed, p.hiding))
    t_warm = time.perf_counter()
    warm = warm_start(p, deadline)
    warm_s = time.perf_counter() - t_warm
    flat = placement_variables(p.topo, options) <= pl.exact_max_variables
    candidates = [(warm, PlacementSource.warm_start)] if warm is not None else []
    if flat:
        # the aggregated MIP first (a fraction of the time limit): its bound lets the exact model stop at the gap
        agg = dataclasses.replace(p, time_limit_s=max(MIN_SOLVE_S, AGGREGATE_SHARE * pl.time_limit_s),
                                  gap=p.gap * AGGREGATE_GAP_SHARE, deadline=deadline, late_ok=warm is None)
        agg_bound, agg_plan = aggregate_bound(agg, warm) if not agg.out_of_time() else (0.0, None)
        if agg_plan is not None:
            candidates.append((agg_plan, PlacementSource.ilp_choice))
        bound, status = max(agg_bound, p.known_bound_ms), "feasible"
        best = min((c for c, _ in candidates), key=p.makespan) if candidates else None
        if bound == float("inf"):
            status = "infeasible"
        elif best is None or gap_of(p, p.makespan(best), bound) > p.gap:
            placed, bound, status = solve_exact(p, best, bound, deadline)
            candidates += [(plan, PlacementSource.ilp) for plan in placed]
        else:
            status = "optimal"
    else:
        out = solve_decomposed(p, warm, deadline - PLACEMENT_RESERVE * warm_s)
        candidates += out.plans
        bound, status = out.bound, out.status
    # the warm start first: it is kept unless another plan is strictly better
    if not candidates:
        raise InfeasibleError(_no_placement(cfg, p, status))
    bound = max(bound if bound != float("inf") else 0.0, p.known_bound_ms)
    if gap_of(p, min(p.makespan(c) for c, _ in candidates), bound) > p.gap:
        # the time left on switching options of the busiest device, from each plan found (best first)
        for plan, source in sorted(candidates, key=lambda cs: p.makespan(cs[0])):
            if time.perf_counter() >= deadline:
                break
            candidates.append((switch_options(p, plan, bound, deadline), source))
    best, source = min(candidates, key=lambda cs: p.makespan(cs[0]))
    makespan = p.makespan(best)
    gap = gap_of(p, makespan, bound)
    final = ("optimal" if gap <= OPTIMAL_GAP else "within_gap" if gap <= pl.mip_gap
             else "time_limit" if status == "feasible" else "feasible")
    return SolveResult(placements=tuple(best), algorithm="ilp" if flat else "ilp (decomposed)", status=final,
                       seconds=time.perf_counter() - t0, lower_bound_ms=bound, placement_source=source)
