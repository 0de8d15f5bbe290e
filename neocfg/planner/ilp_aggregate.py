"""The aggregated option-choice ILP of the decomposition (large instances).

Devices are identical and nodes symmetric, so which device gets which piece is left to the placement stage; the
model only chooses one option per table, subject to what every plan must satisfy:
  average      T >= U + sum of placed work / W                 (U: time of uniform row-wise/data-parallel options)
  piece        T >= U + the piece time of each table's option
  memory       total memory per tier <= W x capacity; U's memory + any one piece <= capacity
  piece count  more than (k-1) x W pieces put k pieces of distinct tables on some device (y_k), which weigh at
               least the k smallest per-table piece times, and (threshold cuts) k x lam - sum max(0, lam - piece)
  fixed        every device pays F (SharedFixed: base, routing per piece, each collective group used), and the device
               busiest with pieces at least one lookup group: both are added to every time bound above
Every feasible plan satisfies these, so the model's optimum, and CBC's proven bound on it, bound every plan from
below (at full capacity)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.ilp_problem import IlpProblem, SharedFixed, run_model
from neocfg.planner.types import Placement, ShardingOption, Storage

# Piece-count levels modelled (more only tighten a bound the average already gives).
MAX_PIECE_LEVELS = 32
# Budget of constraint nonzeros for the threshold cuts (keeps the model small for large instances).
THRESHOLD_NONZEROS = 200_000


@dataclass
class AggregateModel:
    p: IlpProblem
    capacity: Storage
    prob: pulp.LpProblem = field(default_factory=lambda: pulp.LpProblem("neocfg_aggregate", pulp.LpMinimize))
    xs: list[list[pulp.LpVariable]] = field(default_factory=list)
    levels: list[tuple[int, pulp.LpVariable]] = field(default_factory=list)

    def __post_init__(self) -> None:
        prob, p, cap, w = self.prob, self.p, self.capacity, self.p.topo.world
        self.T = cbc.var(prob, "T", low=0)
        self.U = cbc.var(prob, "U", low=0)      # time every device spends on uniform (RW/DP) pieces
        self.Uh = cbc.var(prob, "Uh", low=0)    # their HBM on every device
        self.Us = cbc.var(prob, "Us", low=0)    # their host memory on every device
        self.xs = [[cbc.var(prob, f"x_{t}_{i}", cat="Binary") for i in range(len(opts))]
                   for t, opts in enumerate(p.options)]
        self.pairs = [(x, o) for t, opts in enumerate(p.options) for x, o in zip(self.xs[t], opts)]
        self.shared = SharedFixed.build(prob, p, self.xs, binary=False)
        self.F = cbc.var(prob, "F", low=0)      # the fixed time every device pays
        prob += self.F == self.shared.expr, "shared_fixed"
        uniform = [(x, o) for x, o in self.pairs if o.is_uniform]
        for t, row in enumerate(self.xs):
            prob += pulp.lpSum(row) == 1, f"one_{t}"
        prob += self.U == pulp.lpSum(o.perf.total * x for x, o in uniform)
        prob += self.Uh == pulp.lpSum(o.storage.hbm * x for x, o in uniform)
        prob += self.Us == pulp.lpSum(o.storage.host * x for x, o in uniform)
        prob += self.T >= self.base + pulp.lpSum(o.total_work / w * x for x, o in self.placed), "average"
        prob += pulp.lpSum(o.storage.hbm * o.num_pieces * x for x, o in self.pairs) <= cap.hbm * w, "hbm_total"
        prob += pulp.lpSum(o.storage.host * o.num_pieces * x for x, o in self.pairs) <= cap.host * w, "host_total"
        prob += self.Uh <= cap.hbm
        prob += self.Us <= cap.host
        for t, opts in enumerate(p.options):
            mine = [(x, o) for x, o in zip(self.xs[t], opts) if not o.is_uniform]
            if not mine:
                continue
            prob += self.T >= self.base + pulp.lpSum(o.perf.total * x for x, o in mine), f"piece_{t}"
            prob += self.Uh + pulp.lpSum(o.storage.hbm * x for x, o in mine) <= cap.hbm, f"piece_hbm_{t}"
            prob += self.Us + pulp.lpSum(o.storage.host * x for x, o in mine) <= cap.host, f"piece_host_{t}"
        self._add_piece_levels()

    @property
    def base(self):
        """Time on the busiest device besides its placed pieces: uniform options, the dense part, the fixed costs
        every device pays and one lookup group."""
        group = self.p.fixed.group_ms if self.p.options else 0.0
        return self.U + self.F + self.p.offset_ms + group

    @property
    def placed(self) -> list[tuple[pulp.LpVariable, ShardingOption]]:
        return [(x, o) for x, o in self.pairs if not o.is_uniform]

    def _add_piece_levels(self) -> None:
        w, prob = self.p.topo.world, self.prob
        inf = float("inf")
        q = sorted(min((o.perf.total for o in opts if not o.is_uniform), default=inf) for opts in self.p.options)
        q = [x for x in q if x != inf]
        most = sum(max((o.num_pieces for o in opts if not o.is_uniform), default=0) for opts in self.p.options)
        count = cbc.var(prob, "pieces", low=0)   # pieces placed (one variable: each level row names it once)
        prob += count == pulp.lpSum(o.num_pieces * x for x, o in self.placed), "pieces"
        for k in range(1, min(len(q), MAX_PIECE_LEVELS) + 1):
            if most <= (k - 1) * w:
                break
            y = cbc.var(prob, f"y_{k}", cat="Binary")
            prob += count <= (k - 1) * w + (most - (k - 1) * w) * y, f"level_{k}"
            if self.levels:
                prob += self.levels[-1][1] >= y
            self.levels.append((k, y))
        self.count = count
        if self.levels:
            prob += self.T >= self.base + pulp.lpSum(q[k - 1] * y for k, y in self.levels), "piece_levels"
            self._add_threshold_cuts()

    def _add_threshold_cuts(self) -> None:
        placed = self.placed
        values = sorted({round(o.perf.total, 12) for _, o in placed})
        per_level = max(0, min(len(values), THRESHOLD_NONZEROS // (len(placed) * len(self.levels))))
        if per_level == 0:
            return
        lams = sorted({values[min(len(values) - 1, (j * len(values)) // per_level)] for j in range(per_level)})
        for k, y in self.levels:
            for j, lam in enumerate(lams):
                slack = pulp.lpSum((lam - o.perf.total) * x for x, o in placed if o.perf.total < lam)
                self.prob += self.T >= self.base + k * lam * y - slack, f"threshold_{k}_{j}"

    def set_objective(self, weight: float) -> None:
        self.prob += self.T + weight * pulp.lpSum(o.total_comm * x for x, o in self.pairs)

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None:
        chosen = {id(pl.option) for pl in warm}
        for x, o in self.pairs:
            x.setInitialValue(1.0 if id(o) in chosen else 0.0)
        picked = [o for _, o in self.pairs if id(o) in chosen]
        self.U.setInitialValue(sum(o.perf.total for o in picked if o.is_uniform))
        self.Uh.setInitialValue(sum(o.storage.hbm for o in picked if o.is_uniform))
        self.Us.setInitialValue(sum(o.storage.host for o in picked if o.is_uniform))
        self.shared.warm_start(picked)
        self.F.setInitialValue(self.p.fixed.shared_ms({o.sharding for o in picked}, sum(len(pl.ranks) for pl in warm)))
        self.T.setInitialValue(upper)
        pieces = sum(o.num_pieces for o in picked if not o.is_uniform)
        for k, y in self.levels:
            y.setInitialValue(1.0 if pieces > (k - 1) * self.p.topo.world else 0.0)
        self.count.setInitialValue(pieces)

    def picked(self) -> list[ShardingOption]:
        return [opts[max(range(len(opts)), key=lambda j: self.xs[t][j].value() or 0.0)]
                for t, opts in enumerate(self.p.options)]


def solve_aggregate(p: IlpProblem, warm: Optional[Sequence[Placement]],
                    capacity_scale: float) -> tuple[Optional[list[ShardingOption]], float, str]:
    """Choose one option per table. Returns (options or None, bound on the makespan, status); the bound is valid for
    every plan only at capacity_scale 1 (a smaller capacity is a restriction), else 0. Uses p.time_limit_s."""
    cap = Storage(int(p.capacity.hbm * capacity_scale), int(p.capacity.host * capacity_scale))
    model = AggregateModel(p, cap)
    out, weight = run_model(p, model, warm)
    full = capacity_scale >= 1.0
    bound = p.bound_on_makespan(out.bound, weight) if full else 0.0
    if out.objective is None:
        return None, (float("inf") if out.status == "infeasible" and full else bound), out.status
    return model.picked(), bound, out.status
