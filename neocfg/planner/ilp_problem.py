"""What both ILP models share: the instance (IlpProblem) and how solver numbers map back to milliseconds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.fixed import ZERO, FixedCosts, plan_embedding_ms
from neocfg.planner.hiding import NO_HIDING, Hiding
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, Storage, Topology
from neocfg.types import MipSolver, ShardingType

Options = Sequence[Sequence[ShardingOption]]
# The shortest time limit a solver is started with (CBC takes whole seconds).
MIN_SOLVE_S = 1.0
# While no plan is in hand (late_ok), the deadline moves by this share of planner.time_limit_s: a plan somewhat late
# is better than none on memory-tight models.
MIN_SOLVE_SHARE = 0.25


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
    # The embedding part's fixed costs (collective latency per kind used, routing and exchange, kernels per TBE group).
    fixed: FixedCosts = ZERO
    solver: MipSolver = MipSolver.cbc
    # time.perf_counter() by which the solver must stop (model building counts against it); None: time_limit_s
    deadline: Optional[float] = None
    # No plan is in hand yet: the solver may run MIN_SOLVE_SHARE of time_limit_s past the deadline.
    late_ok: bool = False
    # A proven lower bound on the makespan found elsewhere (the aggregated model's, before the exact model runs): the
    # exact model starts from it, so its solver can stop once a plan is within the gap of it.
    known_bound_ms: float = 0.0
    # Each rank's capacity where devices differ (CostModel.rank_capacity): the exact model's memory rows; `capacity`
    # (the smallest) is what the heuristics place against.
    rank_capacity: tuple[Storage, ...] = ()
    # What the bottom MLP hides of the outputs' all-to-all under output_overlap (hiding.py): off by default.
    hiding: Hiding = NO_HIDING

    def capacity_of(self, rank: int) -> Storage:
        return self.rank_capacity[rank] if self.rank_capacity else self.capacity

    @property
    def most_capacity(self) -> Storage:
        """The largest rank's capacity: what relaxations (the aggregated model's bound) may use."""
        if not self.rank_capacity:
            return self.capacity
        return Storage(max(c.hbm for c in self.rank_capacity), max(c.host for c in self.rank_capacity))

    def stop_at(self) -> float:
        """time.perf_counter() by which to stop: the deadline, later by MIN_SOLVE_SHARE of time_limit_s while no
        plan is in hand (late_ok)."""
        start = self.deadline if self.deadline is not None else time.perf_counter() + self.time_limit_s
        return start + (MIN_SOLVE_SHARE * self.time_limit_s if self.late_ok else 0.0)

    def out_of_time(self) -> bool:
        """Too little time is left to start a solver (MIN_SOLVE_S before stop_at)."""
        return self.deadline is not None and self.stop_at() - time.perf_counter() < MIN_SOLVE_S

    def seconds_left(self) -> float:
        """The solver's time limit: time_limit_s, or what is left until stop_at (at least MIN_SOLVE_S)."""
        if self.deadline is None:
            return self.time_limit_s
        return max(MIN_SOLVE_S, min(self.time_limit_s, self.stop_at() - time.perf_counter()))

    def makespan(self, placements: Sequence[Placement]) -> float:
        """The busiest device's embedding time (ms), fixed costs included, less what the bottom MLP hides: the step
        time less the dense part."""
        times = DeviceLoads.of(self.topo, self.capacity, placements).time
        if self.hiding.on:
            times = times - self.hiding.device_hidden(self.topo, placements)
        return plan_embedding_ms(self.topo, self.fixed, times, placements)

    @property
    def worst_comm(self) -> float:
        return sum(max(o.total_comm for o in opts) for opts in self.options)

    def tiebreak_weight(self, upper: float) -> float:
        """Weight of total comm such that it can shift the objective by at most tiebreak x upper bound."""
        worst = self.worst_comm
        return self.tiebreak * upper / worst if worst > 0 and upper > 0 else 0.0

    def bound_on_makespan(self, bound: Optional[float], weight: float) -> float:
        """CBC's bound on (step time + weight x comm) -> a bound on the busiest device's embedding time."""
        if bound is None:
            return 0.0
        return max(0.0, bound - weight * self.worst_comm - self.offset_ms)

    @property
    def pinned(self) -> set[int]:
        """Ranks some table is forced onto."""
        return {r for opts in self.options for o in opts if o.fixed_ranks is not None for r in o.fixed_ranks}


@dataclass
class SharedFixed:
    """The fixed time every device pays, as a function of the option choice (FixedCosts in a model): the base and
    each collective group's latency times its "used" variable, which is >= every table's choice of a sharding type
    of that group (1 in any integer plan that uses the group). Binary in
    the flat model (the solver branches on whether a group is used: dlrm_tiny x 8 closes in seconds instead of not
    at all), continuous in the aggregate (its binaries keep CBC from finding any solution of memory-tight prod_856 x
    16 in time; with x integral the minimization sets it to 0 or 1 anyway)."""

    base_ms: float
    terms: list[tuple[pulp.LpVariable, float]] = field(default_factory=list)   # F = base_ms + sum(coef x var)
    used: list[tuple[frozenset[ShardingType], pulp.LpVariable]] = field(default_factory=list)

    @staticmethod
    def build(prob: pulp.LpProblem, p: IlpProblem, xs: Sequence[Sequence[pulp.LpVariable]],
              binary: bool) -> "SharedFixed":
        f = p.fixed
        out = SharedFixed(f.base_ms)
        for g, (kinds, ms) in enumerate(f.kinds):
            rows = [[x for x, o in zip(row, opts) if o.sharding in kinds] for row, opts in zip(xs, p.options)]
            rows = [r for r in rows if r]
            if ms <= 0 or not rows:
                continue
            u = cbc.var(prob, f"used_{g}", cat="Binary") if binary else cbc.var(prob, f"used_{g}", low=0)
            for t, r in enumerate(rows):
                cbc.row(prob, [(u, 1.0)] + [(x, -1.0) for x in r], pulp.LpConstraintGE, 0.0, f"used_{g}_{t}")
            out.used.append((kinds, u))
            out.terms.append((u, ms))
        return out

    def define(self, prob: pulp.LpProblem) -> pulp.LpVariable:
        """The variable F = the fixed time every device pays."""
        f = cbc.var(prob, "F", low=0)
        cbc.row(prob, [(f, 1.0)] + [(v, -c) for v, c in self.terms], pulp.LpConstraintEQ, self.base_ms,
                "shared_fixed")
        return f

    def warm_start(self, chosen: Iterable[ShardingOption]) -> None:
        kinds = {o.sharding for o in chosen}
        for ks, u in self.used:
            u.setInitialValue(1.0 if ks & kinds else 0.0)


class IlpModel(Protocol):
    prob: pulp.LpProblem

    def set_objective(self, weight: float) -> None: ...

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None: ...


def run_model(p: IlpProblem, model: IlpModel, warm: Optional[Sequence[Placement]],
              relax: bool = False) -> tuple[cbc.MipOutcome, float]:
    """Objective (step time + tie-breaker on comm), warm start from `warm` (in the model's numbering), the solver;
    relax: its LP relaxation only. Returns the solver's outcome and the tie-breaker weight (to turn the solver's
    bound into one on the makespan)."""
    upper = p.makespan(warm) + p.offset_ms if warm else 0.0
    weight = p.tiebreak_weight(upper or 1.0)
    model.set_objective(weight)
    if warm and not relax:
        model.warm_start(warm, upper)
    if p.solver is MipSolver.highs:
        from neocfg.planner import highs

        return highs.solve(model.prob, p.seconds_left(), p.gap, warm=bool(warm), relax=relax), weight
    return cbc.solve(model.prob, p.seconds_left(), p.gap, warm=bool(warm), relax=relax), weight
