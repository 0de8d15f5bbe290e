"""How many DPP workers a service starts: `dsi.workers` fixed, or `auto` from the planner's DPP sizing.

`auto` takes `Plan.dpp.workers` (the planner sizes DPP from the trainers' demand and the per-sample preprocessing
cost, neocfg/planner). Only when no DPP sizing is available (the planner is not installed, or its plan has none) it
falls back to a local estimate: one worker per trainer rank plus `dsi.headroom`, i.e. ceil(world * (1 + headroom)).
The local backend runs one service per trainer rank over that rank's share of the splits, so each service gets
ceil(total / world) workers, capped by `dsi.max_workers`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from neocfg.config.schema import NeocfgConfig
from neocfg.plan import Plan
from neocfg.types import PlannerAlgorithm


class WorkerCountSource(Enum):
    fixed = "fixed"            # dsi.workers=<n>
    planner = "planner"        # Plan.dpp.workers
    estimate = "estimate"      # no DPP sizing available: ceil(world * (1 + headroom))


@dataclass(frozen=True)
class WorkerCount:
    total: int
    per_service: int
    source: WorkerCountSource


def _planned(cfg: NeocfgConfig) -> Optional[Plan]:
    if cfg.planner.plan_file:
        from neocfg.plan_check import load_plan_file

        return load_plan_file(cfg.planner.plan_file, cfg.model)
    try:
        from neocfg.planner import make_plan
    except ImportError:
        return None
    # DPP demand depends on the step time, not on the exact placement: the fast greedy planner is enough here.
    quick = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, algorithm=PlannerAlgorithm.greedy))
    return make_plan(quick)


def worker_count(cfg: NeocfgConfig, world_size: int, plan: Optional[Plan] = None) -> WorkerCount:
    d = cfg.dsi
    if d.workers != "auto":
        total, source = int(d.workers), WorkerCountSource.fixed
    else:
        plan = plan or _planned(cfg)
        if plan is not None and plan.dpp is not None:
            total, source = max(1, plan.dpp.workers), WorkerCountSource.planner
        else:
            total, source = math.ceil(world_size * (1.0 + d.headroom)), WorkerCountSource.estimate
    per_service = min(max(1, math.ceil(total / world_size)), d.max_workers)
    return WorkerCount(total=total, per_service=per_service, source=source)


def workers_needed(demand_samples_per_s: float, per_worker_samples_per_s: float, headroom: float) -> int:
    """Workers that meet a trainer demand with `headroom` spare: ceil(demand * (1 + headroom) / per-worker rate)."""
    return max(1, math.ceil(demand_samples_per_s * (1.0 + headroom) / per_worker_samples_per_s))
