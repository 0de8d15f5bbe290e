"""What both ILP models share: the instance (IlpProblem) and how solver numbers map back to milliseconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, Storage, Topology

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

    def makespan(self, placements: Sequence[Placement]) -> float:
        """The busiest device's embedding time (ms)."""
        return float(DeviceLoads.of(self.topo, self.capacity, placements).time.max())

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


class IlpModel(Protocol):
    prob: pulp.LpProblem

    def set_objective(self, weight: float) -> None: ...

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None: ...


def run_model(p: IlpProblem, model: IlpModel, warm: Optional[Sequence[Placement]]) -> tuple[cbc.CbcOutcome, float]:
    """Objective (step time + tie-breaker on comm), warm start from `warm` (in the model's numbering), CBC.
    Returns CBC's outcome and the tie-breaker weight (to turn CBC's bound into one on the makespan)."""
    upper = p.makespan(warm) + p.offset_ms if warm else 0.0
    weight = p.tiebreak_weight(upper or 1.0)
    model.set_objective(weight)
    if warm:
        model.warm_start(warm, upper)
    return cbc.solve(model.prob, p.time_limit_s, p.gap, warm=bool(warm)), weight
