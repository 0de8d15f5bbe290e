"""The ILP planner (PuLP + bundled CBC).

Small instances (at most `planner.exact_max_variables` option x device variables) are solved as one flat model:
choose one option per table, put every piece on a device (distinct devices for column slices, one node for
table-row-wise / table-column-wise), per-device memory per tier, minimize the busiest device's time (plus a tiny
tie-breaker on total communication). With gap 0 that is exactly optimal.

Large instances use the structure: devices are identical and nodes symmetric, so the option choice is solved on an
aggregated model (per-device average, largest single piece on top of the uniform row-wise/data-parallel load,
total memory per tier) whose optimum, and CBC's proven bound on it, bound every plan from below; the chosen pieces
are then placed largest first onto the least-loaded device and improved by moves off the busiest device. The greedy
plan warm-starts the solver and is kept when it is better.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import pulp

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import InfeasibleError
from neocfg.planner import cbc
from neocfg.planner.bounds import simple_lower_bound
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.greedy import greedy_place
from neocfg.planner.improve import improve
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, SolveResult, Spread, Storage, Topology

Options = Sequence[Sequence[ShardingOption]]
# (fraction of the memory capacity the aggregated model may use, largest piece share) tried in turn when placing
# the chosen pieces runs into fragmentation (the aggregate only knows total memory).
# With the piece share < 1, options whose piece needs more than that share of a device's memory are left out too
# (smaller pieces pack; the last resort of memory-tight models).
_AGGREGATE_CAPACITY_STEPS = ((1.0, 1.0), (0.97, 1.0), (0.9, 1.0), (0.9, 0.5), (0.85, 0.25))
# Piece-count levels modelled in the aggregated option choice (more only tighten a bound the average already gives).
_MAX_PIECE_LEVELS = 32
# Budget of constraint nonzeros for the threshold cuts (keeps the aggregated model small for large instances).
_THRESHOLD_NONZEROS = 200_000


@dataclass(frozen=True)
class IlpProblem:
    topo: Topology
    capacity: Storage
    options: Options
    names: tuple[str, ...]
    time_limit_s: float
    gap: float
    tiebreak: float           # cfg.planner.costs.comm_tiebreak
    # Time every device spends on the dense part: in the models so that the relative gap is that of the step time.
    offset_ms: float = 0.0


def placement_variables(topo: Topology, options: Options) -> int:
    """Placement decisions of the flat model (decides flat vs decomposed)."""
    per = {Spread.one: topo.world, Spread.distinct: topo.world, Spread.node_distinct: topo.world + topo.nodes,
           Spread.node: topo.nodes, Spread.world: 1}
    return sum(1 if o.fixed_ranks is not None else per[o.spread] for opts in options for o in opts)


def _makespan(p: IlpProblem, placements: Sequence[Placement]) -> float:
    return float(DeviceLoads.of(p.topo, p.capacity, placements).time.max())


def _tiebreak_weight(p: IlpProblem, upper: float) -> float:
    """Weight of total comm such that it can shift the objective by at most tiebreak x upper bound."""
    worst = sum(max(o.total_comm for o in opts) for opts in p.options)
    return p.tiebreak * upper / worst if worst > 0 and upper > 0 else 0.0


def _start(x: pulp.LpVariable, value: float) -> None:
    x.setInitialValue(value)


# ---- flat exact model ------------------------------------------------------------------------------------
def solve_flat(p: IlpProblem, warm: Optional[Sequence[Placement]]) -> tuple[Optional[list[Placement]], float, str]:
    """Returns (placements or None, proven lower bound on the makespan, status)."""
    topo, w = p.topo, p.topo.world
    prob = pulp.LpProblem("neocfg_flat", pulp.LpMinimize)
    T = cbc.var(prob, "T", low=0)
    time_terms: list[list] = [[] for _ in range(w)]
    hbm_terms: list[list] = [[] for _ in range(w)]
    host_terms: list[list] = [[] for _ in range(w)]
    choose: list[list[pulp.LpVariable]] = []
    dev_vars: dict[tuple[int, int], dict[int, pulp.LpVariable]] = {}
    node_vars: dict[tuple[int, int], dict[int, pulp.LpVariable]] = {}

    def load(d: int, o: ShardingOption, var: pulp.LpVariable) -> None:
        time_terms[d].append((var, o.perf.total))
        hbm_terms[d].append((var, o.storage.hbm))
        host_terms[d].append((var, o.storage.host))

    for t, opts in enumerate(p.options):
        xs = [cbc.var(prob, f"x_{t}_{i}", cat="Binary") for i in range(len(opts))]
        choose.append(xs)
        prob += pulp.lpSum(xs) == 1, f"one_{t}"
        for i, o in enumerate(opts):
            x = xs[i]
            if o.fixed_ranks is not None or o.spread is Spread.world:
                for d in (o.fixed_ranks if o.fixed_ranks is not None else range(w)):
                    load(d, o, x)
                continue
            if o.spread in (Spread.node, Spread.node_distinct):
                ns = {n: cbc.var(prob, f"n_{t}_{i}_{n}", cat="Binary") for n in range(topo.nodes)}
                node_vars[(t, i)] = ns
                prob += pulp.lpSum(ns.values()) == x
                if o.spread is Spread.node:
                    for d in range(w):
                        load(d, o, ns[topo.node_of(d)])
                    continue
            zs = {d: cbc.var(prob, f"z_{t}_{i}_{d}", cat="Binary") for d in range(w)}
            dev_vars[(t, i)] = zs
            prob += pulp.lpSum(zs.values()) == o.num_pieces * x
            if o.spread is Spread.node_distinct:
                for d, z in zs.items():
                    prob += z <= node_vars[(t, i)][topo.node_of(d)]
            for d, z in zs.items():
                load(d, o, z)
    dev_time = [pulp.lpSum(c * v for v, c in time_terms[d]) for d in range(w)]
    prob += T >= p.offset_ms + simple_lower_bound(topo, p.options), "known_bound"
    for d in range(w):
        prob += dev_time[d] + p.offset_ms <= T, f"time_{d}"
        prob += pulp.lpSum(c * v for v, c in hbm_terms[d]) <= p.capacity.hbm, f"hbm_{d}"
        prob += pulp.lpSum(c * v for v, c in host_terms[d]) <= p.capacity.host, f"host_{d}"
    # Identical devices, symmetric nodes: only plans whose free devices (no forced shard) are sorted by load within
    # each node, and (without forced shards) whose nodes are sorted by their busiest device, are considered; every
    # plan has such a permutation.
    pinned = _pinned(p)
    free = [d for d in range(w) if d not in pinned]
    for a, b in zip(free, free[1:]):
        if topo.node_of(a) == topo.node_of(b):
            prob += dev_time[a] >= dev_time[b], f"sym_{a}"
    if not pinned:
        for n in range(topo.nodes - 1):
            prob += dev_time[n * topo.devices_per_node] >= dev_time[(n + 1) * topo.devices_per_node], f"symnode_{n}"
    if warm:
        warm = canonical(topo, p.capacity, warm, pinned)
    upper = _makespan(p, warm) + p.offset_ms if warm else 0.0
    weight = _tiebreak_weight(p, upper or 1.0)
    comm = pulp.lpSum(o.total_comm * choose[t][i] for t, opts in enumerate(p.options) for i, o in enumerate(opts))
    prob += T + weight * comm
    if warm:
        _warm_flat(p, warm, choose, dev_vars, node_vars, T, upper)
    out = cbc.solve(prob, p.time_limit_s, p.gap, warm=bool(warm))
    if out.objective is None:
        if out.status == "infeasible":
            return None, float("inf"), "infeasible"
        return None, _bound_on_makespan(out.bound, weight, p), out.status
    placements = []
    for t, opts in enumerate(p.options):
        i = max(range(len(opts)), key=lambda j: choose[t][j].value() or 0.0)
        placements.append(_read_placement(p.topo, t, i, opts[i], dev_vars, node_vars))
    return placements, _bound_on_makespan(out.bound, weight, p), out.status


def _bound_on_makespan(bound: Optional[float], weight: float, p: IlpProblem) -> float:
    """CBC's bound on (step time + weight x comm) -> a bound on the busiest device's embedding time."""
    if bound is None:
        return 0.0
    worst = sum(max(o.total_comm for o in opts) for opts in p.options)
    return max(0.0, bound - weight * worst - p.offset_ms)


def _pinned(p: IlpProblem) -> set[int]:
    return {r for opts in p.options for o in opts if o.fixed_ranks is not None for r in o.fixed_ranks}


def canonical(topo: Topology, capacity: Storage, placements: Sequence[Placement],
              pinned: set[int]) -> list[Placement]:
    """The same plan with devices renumbered as the symmetry-breaking constraints want: free devices sorted by load
    within their node; without pinned devices also nodes sorted by their busiest device."""
    time_ = DeviceLoads.of(topo, capacity, placements).time
    pn = topo.devices_per_node
    nodes = list(range(topo.nodes))
    if not pinned:
        nodes.sort(key=lambda n: -max(time_[r] for r in topo.node_ranks(n)))
    new_rank = {}
    for new_node, old_node in enumerate(nodes):
        ranks = topo.node_ranks(old_node)
        free_old = sorted((r for r in ranks if r not in pinned), key=lambda r: -time_[r])
        free_new = [new_node * pn + (r - old_node * pn) for r in ranks if r not in pinned]
        new_rank.update(zip(free_old, free_new))
        new_rank.update({r: r for r in ranks if r in pinned})
    out = []
    for pl in placements:
        ranks = tuple(new_rank[r] for r in pl.ranks)
        if pl.option.spread in (Spread.world, Spread.node):
            ranks = tuple(sorted(ranks))
        out.append(Placement(pl.option, ranks))
    return out


def _warm_flat(p: IlpProblem, warm: Sequence[Placement], choose, dev_vars, node_vars, T, upper: float) -> None:
    for t, pl in enumerate(warm):
        i = next(j for j, o in enumerate(p.options[t]) if o is pl.option)
        for j, x in enumerate(choose[t]):
            _start(x, 1.0 if j == i else 0.0)
        for (tt, ii), zs in dev_vars.items():
            if tt == t:
                for d, z in zs.items():
                    _start(z, 1.0 if ii == i and d in pl.ranks else 0.0)
        for (tt, ii), ns in node_vars.items():
            if tt == t:
                node = p.topo.node_of(pl.ranks[0])
                for n, v in ns.items():
                    _start(v, 1.0 if ii == i and n == node else 0.0)
    _start(T, upper)


def _read_placement(topo: Topology, t: int, i: int, o: ShardingOption, dev_vars, node_vars) -> Placement:
    if o.fixed_ranks is not None:
        return Placement(o, o.fixed_ranks)
    if o.spread is Spread.world:
        return Placement(o, tuple(range(topo.world)))
    if o.spread is Spread.node:
        node = max(node_vars[(t, i)].items(), key=lambda kv: kv[1].value() or 0.0)[0]
        return Placement(o, topo.node_ranks(node))
    zs = dev_vars[(t, i)]
    ranks = sorted(zs, key=lambda d: -(zs[d].value() or 0.0))[:o.num_pieces]
    return Placement(o, tuple(sorted(ranks)))


# ---- decomposition: aggregated option choice, then placement ---------------------------------------------
def solve_aggregate(p: IlpProblem, warm: Optional[Sequence[Placement]], capacity_scale: float,
                    time_limit_s: float) -> tuple[Optional[list[ShardingOption]], float, str]:
    """Choose one option per table on the aggregated model. Returns (options or None, bound on makespan, status).

    The bound is valid for every plan only when capacity_scale == 1 (a tighter capacity is a restriction)."""
    w = p.topo.world
    cap = Storage(int(p.capacity.hbm * capacity_scale), int(p.capacity.host * capacity_scale))
    prob = pulp.LpProblem("neocfg_aggregate", pulp.LpMinimize)
    T = cbc.var(prob, "T", low=0)
    U = cbc.var(prob, "U", low=0)       # time every device spends on uniform (RW/DP) pieces
    Uh = cbc.var(prob, "Uh", low=0)     # their HBM on every device
    Us = cbc.var(prob, "Us", low=0)     # their host memory on every device
    xs = [[cbc.var(prob, f"x_{t}_{i}", cat="Binary") for i in range(len(opts))] for t, opts in enumerate(p.options)]
    pairs = [(x, o) for t, opts in enumerate(p.options) for x, o in zip(xs[t], opts)]
    for t, row in enumerate(xs):
        prob += pulp.lpSum(row) == 1, f"one_{t}"
    prob += U == pulp.lpSum(o.perf.total * x for x, o in pairs if o.is_uniform)
    prob += Uh == pulp.lpSum(o.storage.hbm * x for x, o in pairs if o.is_uniform)
    prob += Us == pulp.lpSum(o.storage.host * x for x, o in pairs if o.is_uniform)
    prob += T >= U + p.offset_ms + pulp.lpSum(o.total_work / w * x for x, o in pairs if not o.is_uniform), "average"
    prob += pulp.lpSum(o.storage.hbm * o.num_pieces * x for x, o in pairs) <= cap.hbm * w, "hbm_total"
    prob += pulp.lpSum(o.storage.host * o.num_pieces * x for x, o in pairs) <= cap.host * w, "host_total"
    prob += Uh <= cap.hbm
    prob += Us <= cap.host
    for t, opts in enumerate(p.options):
        if all(o.is_uniform for o in opts):
            continue
        placed = [(x, o) for x, o in zip(xs[t], opts) if not o.is_uniform]
        prob += T >= U + p.offset_ms + pulp.lpSum(o.perf.total * x for x, o in placed), f"piece_{t}"
        prob += Uh + pulp.lpSum(o.storage.hbm * x for x, o in placed) <= cap.hbm, f"piece_hbm_{t}"
        prob += Us + pulp.lpSum(o.storage.host * x for x, o in placed) <= cap.host, f"piece_host_{t}"
    levels = _piece_levels(p, prob, pairs, T, U)
    upper = _makespan(p, warm) + p.offset_ms if warm else 0.0
    weight = _tiebreak_weight(p, upper or 1.0)
    prob += T + weight * pulp.lpSum(o.total_comm * x for x, o in pairs)
    if warm:
        chosen = {id(pl.option) for pl in warm}
        for x, o in pairs:
            _start(x, 1.0 if id(o) in chosen else 0.0)
        _start(U, sum(o.perf.total for x, o in pairs if o.is_uniform and id(o) in chosen))
        _start(Uh, sum(o.storage.hbm for x, o in pairs if o.is_uniform and id(o) in chosen))
        _start(Us, sum(o.storage.host for x, o in pairs if o.is_uniform and id(o) in chosen))
        _start(T, upper)
        pieces = sum(o.num_pieces for o in (pl.option for pl in warm) if not o.is_uniform)
        for k, y in levels:
            _start(y, 1.0 if pieces > (k - 1) * w else 0.0)
    out = cbc.solve(prob, time_limit_s, p.gap, warm=bool(warm))
    bound = _bound_on_makespan(out.bound, weight, p) if capacity_scale >= 1.0 else 0.0
    if out.objective is None:
        return None, (float("inf") if out.status == "infeasible" and capacity_scale >= 1.0 else bound), out.status
    picked = []
    for t, opts in enumerate(p.options):
        i = max(range(len(opts)), key=lambda j: xs[t][j].value() or 0.0)
        picked.append(opts[i])
    return picked, bound, out.status


def _piece_levels(p: IlpProblem, prob: pulp.LpProblem, pairs, T, U) -> list[tuple[int, pulp.LpVariable]]:
    """Piece-count cuts: if the plan has more than (k-1) x W pieces, some device holds k pieces of distinct tables,
    which take at least the k smallest per-table piece times s_1..s_k. y_k = 1 when the count exceeds (k-1) x W."""
    w = p.topo.world
    q = sorted(min((o.perf.total for o in opts if not o.is_uniform), default=float("inf")) for opts in p.options)
    q = [x for x in q if x != float("inf")]
    most = sum(max((o.num_pieces for o in opts if not o.is_uniform), default=0) for opts in p.options)
    count = pulp.lpSum(o.num_pieces * x for x, o in pairs if not o.is_uniform)
    levels: list[tuple[int, pulp.LpVariable]] = []
    for k in range(1, min(len(q), _MAX_PIECE_LEVELS) + 1):
        if most <= (k - 1) * w:
            break
        y = cbc.var(prob, f"y_{k}", cat="Binary")
        prob += count <= (k - 1) * w + (most - (k - 1) * w) * y, f"level_{k}"
        if levels:
            prob += levels[-1][1] >= y
        levels.append((k, y))
    if levels:
        prob += T >= U + p.offset_ms + pulp.lpSum(q[k - 1] * y for k, y in levels), "piece_levels"
        _threshold_cuts(p, prob, pairs, levels, T, U)
    return levels


def _threshold_cuts(p: IlpProblem, prob: pulp.LpProblem, pairs, levels, T, U) -> None:
    """Sharper piece-count cuts: the k pieces of distinct tables on a device with k pieces weigh at least
    k x lam - sum over placed tables of max(0, lam - their piece time), for any lam (LP duality of "the k smallest").
    """
    placed = [(x, o) for x, o in pairs if not o.is_uniform]
    if not placed:
        return
    values = sorted({round(o.perf.total, 12) for _, o in placed})
    per_level = max(0, min(len(values), _THRESHOLD_NONZEROS // (len(placed) * len(levels))))
    if per_level == 0:
        return
    lams = [values[min(len(values) - 1, (j * len(values)) // per_level)] for j in range(per_level)]
    for k, y in levels:
        for j, lam in enumerate(sorted(set(lams))):
            slack = pulp.lpSum((lam - o.perf.total) * x for x, o in placed if o.perf.total < lam)
            prob += T >= U + p.offset_ms + k * lam * y - slack, f"threshold_{k}_{j}"


def _small_pieces(p: IlpProblem, share: float) -> list[list[ShardingOption]]:
    def fraction(o: ShardingOption) -> float:
        return max(o.storage.hbm / max(p.capacity.hbm, 1), o.storage.host / max(p.capacity.host, 1))

    return [[o for o in opts if fraction(o) <= share] or [min(opts, key=fraction)] for opts in p.options]


def _place_chosen(p: IlpProblem, picked: Sequence[ShardingOption]) -> Optional[list[Placement]]:
    """Place the chosen options: largest work first and largest memory first, each improved; the better one."""
    single = [[o] for o in picked]
    found = []
    for by_memory in (False, True):
        try:
            placed = list(greedy_place(p.topo, p.capacity, single, p.names, by_memory=by_memory))
        except InfeasibleError:
            continue
        found.append(improve(p.topo, p.capacity, placed))
    return min(found, key=lambda c: _makespan(p, c)) if found else None


def solve_decomposed(p: IlpProblem, warm: Optional[Sequence[Placement]],
                     deadline: float) -> tuple[Optional[list[Placement]], float, str]:
    best: Optional[list[Placement]] = None
    bound, status = 0.0, "not_solved"
    for scale, share in _AGGREGATE_CAPACITY_STEPS:
        left = deadline - time.perf_counter()
        if left < 1.0:
            break
        restricted = p if share >= 1.0 else dataclasses.replace(p, options=_small_pieces(p, share))
        picked, b, st = solve_aggregate(restricted, warm if share >= 1.0 else None, scale, left)
        if scale >= 1.0:
            bound, status = b, st
            if b == float("inf"):
                return None, b, "infeasible"
        if picked is None:
            continue
        placed = _place_chosen(p, picked)
        if placed is None:
            continue  # fragmentation: retry with less of the memory
        best = placed
        break
    return best, bound, status


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


def solve_ilp(cfg: NeocfgConfig, cost: CostModel, options: Options) -> SolveResult:
    t0 = time.perf_counter()
    pl = cfg.planner
    p = IlpProblem(topo=cost.topo, capacity=cost.capacity, options=options,
                   names=tuple(t.name for t in cfg.model.tables), time_limit_s=pl.time_limit_s, gap=pl.mip_gap,
                   tiebreak=pl.costs.comm_tiebreak, offset_ms=dense_cost(cfg).perf.total)
    try:
        warm: Optional[list[Placement]] = improve(p.topo, p.capacity, list(greedy_place(p.topo, p.capacity,
                                                                                        options, p.names)))
    except InfeasibleError:
        warm = None
    deadline = t0 + pl.time_limit_s
    flat = placement_variables(p.topo, options) <= pl.exact_max_variables
    if flat:
        found, bound, status = solve_flat(dataclasses.replace(p, time_limit_s=max(1.0, deadline - time.perf_counter())),
                                          warm)
    else:
        found, bound, status = solve_decomposed(p, warm, deadline)
    candidates = [c for c in (found, warm) if c is not None]
    if not candidates:
        raise InfeasibleError(_no_placement(cfg, p, status))
    best = min(candidates, key=lambda c: _makespan(p, c))
    bound = max(bound if bound != float("inf") else 0.0, simple_lower_bound(p.topo, options))
    makespan = _makespan(p, best)
    bound = min(bound, makespan)
    gap = (makespan - bound) / (makespan + p.offset_ms) if makespan + p.offset_ms > 0 else 0.0
    final = ("optimal" if gap <= 1e-6 else "within_gap" if gap <= pl.mip_gap
             else "time_limit" if status == "feasible" else "feasible")
    return SolveResult(placements=tuple(best), algorithm="ilp" if flat else "ilp (decomposed)", status=final,
                       seconds=time.perf_counter() - t0, lower_bound_ms=bound)
