"""The contract between the planner and the runtime: mode=plan and mode=train both get their plan here.

A plan is made (neocfg.planner, with advice when it does not fit), or read from planner.plan_file and checked
against the model and the world by the one validator (neocfg.plan_check, whose table checks are the sharding
types' own and the same the runtime's layout applies), or, in mode=plan, rated as given. The runtime
(neocfg.runtime) receives that validated Plan with its predicted terms and plans nothing itself; neither it nor
neocfg.sharding imports the planner (tests/test_contract.py checks the import rules)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from neocfg.config.schema import NeocfgConfig
from neocfg.plan import Plan
from neocfg.types import PlanExport


def load_or_make_plan(cfg: NeocfgConfig) -> Plan:
    """mode=train's plan: planner.plan_file checked against the model and the world, or a new plan (advice when
    none fits); with the data-parallel tables' backward terms priced for this config. The step's strategies are the
    plan file's when it has them (a note says where this config would choose otherwise), else resolved for cfg."""
    from neocfg.planner.assemble import replica_backward_ms
    from neocfg.planner.strategies import resolve as resolve_strategies
    from neocfg.planner.strategies import with_strategies

    if cfg.planner.plan_file:
        from neocfg.plan_check import load_plan_file

        plan = load_plan_file(cfg.planner.plan_file, cfg.model, cfg.hardware.num_devices)
        if plan.strategies is not None:
            resolved = resolve_strategies(cfg, plan)
            if resolved != plan.strategies:
                print(f"neocfg: note: running the plan file's strategies ({plan.strategies.describe()}); this config"
                      f" would resolve to {resolved.describe()}")
        plan = with_strategies(cfg, plan)
    else:
        from neocfg.planner.advice import plan_or_advise

        plan = plan_or_advise(cfg)
    dp_update, dp_all_reduce = replica_backward_ms(cfg, plan)
    return dataclasses.replace(plan, estimate=dataclasses.replace(plan.estimate, dp_update_ms=dp_update,
                                                                  dp_all_reduce_ms=dp_all_reduce))


def plan(cfg: NeocfgConfig, run_dir: Optional[Path]) -> Plan:
    """mode=plan: plan (or rate planner.plan_file), print the summary, write plan.json and plan.png, and the
    TorchRec plan when planner.export asks for it."""
    from neocfg.planner.advice import advising
    from neocfg.planner.run import run

    with advising(cfg):  # progress while planning; a plan that does not fit ends with checked advice
        made = run(cfg, run_dir)
    if run_dir is not None and cfg.planner.export is PlanExport.torchrec:
        from neocfg.interop.export import EXPORT_FILE, compute_device_of, write_torchrec_plan

        write_torchrec_plan(made, compute_device_of(cfg.hardware.device.kind), run_dir / EXPORT_FILE)
        print(f"TorchRec plan written to {run_dir / EXPORT_FILE} "
              f"(neocfg.interop.torchrec.load_torchrec_plan(path, module) -> ShardingPlan)")
    return made


def train(cfg: NeocfgConfig, run_dir: Optional[Path]) -> dict[str, Any]:
    """mode=train: the runtime trains the plan load_or_make_plan makes."""
    from neocfg.runtime.run import run

    return run(cfg, run_dir, load_or_make_plan)
