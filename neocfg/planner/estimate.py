"""Rate a given plan without solving: `mode=plan planner.plan_file=...` (or a plan converted from TorchRec).

The plan is validated (neocfg.plan_check), each table's sharding becomes the option the solver would have priced
(same cost model: piece time and memory per touched device, fixed costs of the kinds present) placed on the plan's
own ranks, and assemble() turns that into the usual per-device estimates. The plan's own shards are kept; a piece is
priced as the cost model's even split (ceil rows, D/k columns) of its sharding type.

The solver report says `given`: there is no lower bound (0) and so no gap to speak of."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import InfeasibleError
from neocfg.plan import GIVEN_PLAN_ALGORITHM, Plan, SolverReport
from neocfg.plan_check import PlanError, check_plan, load_plan_file
from neocfg.planner.assemble import assemble, replica_backward_ms
from neocfg.planner.costs import GIB, CostModel, dense_cost
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, PlacementSource, ShardingOption, SolveResult
from neocfg.sharding import SCHEMES

GIVEN_STATUS = "given plan, rated without solving (no lower bound)"


def placements_of(cfg: NeocfgConfig, cost: CostModel, plan: Plan) -> tuple[Placement, ...]:
    """One placement per model table (model order): the plan's sharding, tier and dtype on the plan's ranks."""
    out = []
    for i, table in enumerate(cfg.model.tables):
        tp = plan.table(table.name)
        ranks = tuple(s.rank for s in tp.shards)
        k = len(ranks) if SCHEMES[tp.sharding].sliced else 1
        perf, storage = cost.piece(table, tp.sharding, tp.memory, tp.weights_dtype, k)
        option = ShardingOption(i, tp.sharding, tp.memory, tp.weights_dtype, len(ranks), perf, storage,
                                fixed_ranks=ranks)
        out.append(Placement(option, ranks))
    return tuple(out)


def rate_plan(cfg: NeocfgConfig, plan: Plan, source: str, check_memory: bool = True) -> Plan:
    """The plan with neocfg's estimates for cfg's hardware and batch (DPP sized as for a solved plan). check_memory
    False: rate it even where neocfg's memory model says a device would be over its capacity (comparing another
    planner's plan whose memory model differs: the devices' hbm_bytes say by how much)."""
    from neocfg.planner.dpp import size_dpp

    start = time.perf_counter()
    check_plan(plan, source, cfg.model, cfg.hardware.num_devices)
    cost = CostModel.from_config(cfg)
    placements = placements_of(cfg, cost, plan)
    loads = DeviceLoads.of(cost.topo, cost.capacity, placements)
    bad = loads.over_capacity()
    if bad is not None and check_memory:
        raise InfeasibleError(f"{source}: the plan does not fit {cfg.hardware.name}: device {bad} would hold "
                              f"{loads.hbm[bad] / GIB:,.2f} GiB of device memory (usable {cost.capacity.hbm / GIB:,.2f})"
                              f" and {loads.host[bad] / GIB:,.2f} GiB of host DDR (usable "
                              f"{cost.capacity.host / GIB:,.2f})")
    result = SolveResult(placements=placements, algorithm=GIVEN_PLAN_ALGORITHM, status=GIVEN_STATUS, seconds=0.0,
                         lower_bound_ms=0.0, placement_source=PlacementSource.given)
    rated = assemble(cfg, cost, dense_cost(cfg), result, strategies=plan.strategies)
    by_name = {t.name: t for t in plan.tables}
    step = rated.estimate.step_ms
    rated = dataclasses.replace(
        rated, tables=tuple(by_name[t.name] for t in cfg.model.tables),
        solver=SolverReport(algorithm=GIVEN_PLAN_ALGORITHM, status=GIVEN_STATUS,
                            seconds=time.perf_counter() - start, objective_ms=step, lower_bound_ms=0.0, gap=1.0,
                            placement_source=PlacementSource.given.value))
    return size_dpp(cfg, rated)


def rate_plan_file(cfg: NeocfgConfig, path: str | Path) -> Plan:
    plan = load_plan_file(path, cfg.model, cfg.hardware.num_devices)
    return rate_plan(cfg, plan, str(path))


__all__ = ["rate_plan", "rate_plan_file", "placements_of", "replica_backward_ms", "PlanError"]
