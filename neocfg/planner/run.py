"""mode=plan: the dry run. Plans (or, with planner.plan_file, validates and rates that plan without solving), prints
the summary, writes plan.json and plan.png into the run directory (neocfg.contract.plan adds the TorchRec export).

Nothing is written unless planning succeeded; plan.json is written atomically."""

from __future__ import annotations

from pathlib import Path

from neocfg.config.schema import NeocfgConfig
from neocfg.plan import Plan
from neocfg.planner import make_plan
from neocfg.planner.report import save_png, summary


def run(cfg: NeocfgConfig, run_dir: Path | None) -> Plan:
    if cfg.planner.plan_file:
        from neocfg.planner.estimate import rate_plan_file

        plan = rate_plan_file(cfg, cfg.planner.plan_file)
    else:
        plan = make_plan(cfg)
    text = summary(cfg, plan)
    print(text)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(run_dir / "plan.json")
        save_png(cfg, plan, run_dir / "plan.png")
        print(f"plan written to {run_dir / 'plan.json'}, plot {run_dir / 'plan.png'}")
    return plan
