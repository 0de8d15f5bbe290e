"""What both ILP models share: the instance (IlpProblem) and how solver numbers map back to milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.fixed import ZERO, FixedCosts, plan_embedding_ms
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, Storage, Topology
from neocfg.types import MipSolver, ShardingType

Options = Sequence[Sequence[ShardingOption]]


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
    # The embedding part's fixed costs (collective latency per kind used, routing per piece, kernels per lookup group).
    fixed: FixedCosts = ZERO
    solver: MipSolver = MipSolver.cbc

    def makespan(self, placements: Sequence[Placement]) -> float:
        """The busiest device's embedding time (ms), fixed costs included: the step time less the dense part."""
        return plan_embedding_ms(self.topo, self.fixed, DeviceLoads.of(self.topo, self.capacity, placements).time,
                                 placements)

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
    """The fixed time every device pays, as a function of the option choice (FixedCosts in a model): the base, the
    routing of each chosen option's pieces, and each collective group's latency times its binary "used" variable,
    which is >= every table's choice of a sharding type of that group. (Binary rather than continuous: the solver
    can branch on whether a group is used, which closes dlrm_tiny x 8 in seconds instead of not at all.)"""

    expr: pulp.LpAffineExpression
    used: list[tuple[frozenset[ShardingType], pulp.LpVariable]] = field(default_factory=list)

    @staticmethod
    def build(prob: pulp.LpProblem, p: IlpProblem, xs: Sequence[Sequence[pulp.LpVariable]]) -> "SharedFixed":
        f = p.fixed
        pairs = [(x, o) for row, opts in zip(xs, p.options) for x, o in zip(row, opts)]
        expr = pulp.lpSum(f.piece_ms * o.num_pieces * x for x, o in pairs if f.piece_ms) + f.base_ms
        out = SharedFixed(expr)
        for g, (kinds, ms) in enumerate(f.kinds):
            rows = [[x for x, o in zip(row, opts) if o.sharding in kinds] for row, opts in zip(xs, p.options)]
            rows = [r for r in rows if r]
            if ms <= 0 or not rows:
                continue
            u = cbc.var(prob, f"used_{g}", cat="Binary")
            for t, r in enumerate(rows):
                prob += u >= pulp.lpSum(r), f"used_{g}_{t}"
            out.used.append((kinds, u))
            out.expr += ms * u
        return out

    def warm_start(self, chosen: Iterable[ShardingOption]) -> None:
        kinds = {o.sharding for o in chosen}
        for ks, u in self.used:
            u.setInitialValue(1.0 if ks & kinds else 0.0)


class IlpModel(Protocol):
    prob: pulp.LpProblem

    def set_objective(self, weight: float) -> None: ...

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None: ...


def run_model(p: IlpProblem, model: IlpModel, warm: Optional[Sequence[Placement]]) -> tuple[cbc.MipOutcome, float]:
    """Objective (step time + tie-breaker on comm), warm start from `warm` (in the model's numbering), CBC.
    Returns CBC's outcome and the tie-breaker weight (to turn CBC's bound into one on the makespan)."""
    upper = p.makespan(warm) + p.offset_ms if warm else 0.0
    weight = p.tiebreak_weight(upper or 1.0)
    model.set_objective(weight)
    if warm:
        model.warm_start(warm, upper)
    if p.solver is MipSolver.highs:
        from neocfg.planner import highs

        return highs.solve(model.prob, p.time_limit_s, p.gap, warm=bool(warm)), weight
    return cbc.solve(model.prob, p.time_limit_s, p.gap, warm=bool(warm)), weight
