"""Issue 4: dsi.workers=auto takes the planner's DPP sizing; a fixed count overrides it."""

from __future__ import annotations

import dataclasses

from neocfg.data.dpp.sizing import WorkerCountSource, worker_count, workers_needed
from neocfg.plan import DppSizing
from conftest import compose_cfg


def _plan_with_dpp(workers: int):
    from neocfg.planner import make_plan

    cfg = compose_cfg(["dsi=parquet_local", "planner.algorithm=greedy"])
    plan = make_plan(cfg)
    return dataclasses.replace(plan, dpp=DppSizing(workers=workers, workers_per_trainer_node=workers,
                                                   bottleneck="cpu", demand_samples_per_s=1.0,
                                                   capacity_samples_per_s=1.0))


def test_fixed_count_overrides():
    cfg = compose_cfg(["dsi=parquet_local", "dsi.workers=5"])
    wc = worker_count(cfg, world_size=2, plan=_plan_with_dpp(40))
    assert (wc.total, wc.per_service, wc.source) == (5, 3, WorkerCountSource.fixed)


def test_auto_takes_the_planners_sizing_split_over_ranks_and_capped():
    cfg = compose_cfg(["dsi=parquet_local", "dsi.max_workers=4"])
    wc = worker_count(cfg, world_size=2, plan=_plan_with_dpp(7))
    assert (wc.total, wc.per_service, wc.source) == (7, 4, WorkerCountSource.planner)
    wc = worker_count(cfg, world_size=2, plan=_plan_with_dpp(3))
    assert (wc.total, wc.per_service) == (3, 2)


def test_auto_plans_when_no_plan_is_given():
    cfg = compose_cfg(["dsi=parquet_local"])
    wc = worker_count(cfg, world_size=2)
    assert wc.source in (WorkerCountSource.planner, WorkerCountSource.estimate) and wc.per_service >= 1


def test_workers_needed():
    assert workers_needed(1500.0, 1000.0, 0.2) == 2
    assert workers_needed(1000.0, 1000.0, 0.0) == 1
    assert workers_needed(1.0, 1000.0, 0.2) == 1
