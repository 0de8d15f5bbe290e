"""mode=plan: the dry run. Plans (or, with planner.plan_file, validates and rates that plan without solving), prints
the summary and the explanation's top lines, writes plan.json, plan.md (why each table is where it is:
neocfg.planner.explain) and plan.png into the run directory (neocfg.contract.plan adds the TorchRec export).

Nothing is written unless planning succeeded; plan.json is written atomically."""

from __future__ import annotations

from pathlib import Path

from neocfg.config.schema import NeocfgConfig
from neocfg.fileio import write_text_atomic
from neocfg.plan import Plan
from neocfg.planner import make_plan
from neocfg.planner.explain import console_lines, explain, markdown
from neocfg.planner.report import save_png, summary


def run(cfg: NeocfgConfig, run_dir: Path | None) -> Plan:
    if cfg.planner.plan_file:
        from neocfg.planner.estimate import rate_plan_file

        plan = rate_plan_file(cfg, cfg.planner.plan_file)
    else:
        plan = make_plan(cfg)
    why = explain(cfg, plan)
    print("\n".join([summary(cfg, plan), *console_lines(why)]))
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(run_dir / "plan.json")
        write_text_atomic(run_dir / "plan.md", markdown(cfg, plan, why))
        save_png(cfg, plan, run_dir / "plan.png")
        print(f"plan written to {run_dir / 'plan.json'}, why each table is where it is in {run_dir / 'plan.md'},"
              f" plot {run_dir / 'plan.png'}")
    return plan
