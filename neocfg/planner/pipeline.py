"""make_plan: options -> algorithm -> verified placements -> Plan (with DPP sizing)."""

from __future__ import annotations

import time

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import InfeasibleError
from neocfg.plan import Plan
from neocfg.planner.assemble import assemble
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.fixed import FixedCosts
from neocfg.planner.greedy import solve_greedy
from neocfg.planner.hiding import Hiding
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.options import all_options
from neocfg.planner.types import SolveResult
from neocfg.types import PlannerAlgorithm


def solve(cfg: NeocfgConfig, cost: CostModel) -> SolveResult:
    started = time.perf_counter()   # planner.time_limit_s counts from here: enumerating the options is planning too
    options = all_options(cfg, cost)
    names = [t.name for t in cfg.model.tables]
    if cfg.planner.algorithm is PlannerAlgorithm.greedy:
        return solve_greedy(cost.topo, cost.capacity, options, names, FixedCosts.of(cost),
                            Hiding.of(cfg, cost, dense_cost(cfg)))
    from neocfg.planner.ilp import solve_ilp

    return solve_ilp(cfg, cost, options, started=started)


def verify(cost: CostModel, result: SolveResult) -> None:
    """Never hand out an over-full device (a bug guard; every algorithm already respects capacity)."""
    loads = DeviceLoads.of(cost.topo, cost.capacity, result.placements, cost.rank_capacity)
    bad = loads.over_capacity()
    if bad is not None:
        raise InfeasibleError(f"internal check: device {bad} would exceed its memory"
                              f" (hbm {int(loads.hbm[bad]):,} of {int(loads.cap_hbm[bad]):,} bytes,"
                              f" host {int(loads.host[bad]):,} of {int(loads.cap_host[bad]):,}); please report this plan")


def plan_placement(cfg: NeocfgConfig, cost: CostModel | None = None) -> Plan:
    """The plan without DPP sizing (what the benchmark times); `cost` replaces the config's cost model (the TorchRec
    interop's, with TorchRec's per-option terms)."""
    cost = cost if cost is not None else CostModel.from_config(cfg)
    result = solve(cfg, cost)
    verify(cost, result)
    return assemble(cfg, cost, dense_cost(cfg), result)


def make_plan(cfg: NeocfgConfig) -> Plan:
    from neocfg.planner.dpp import size_dpp

    return size_dpp(cfg, plan_placement(cfg))
