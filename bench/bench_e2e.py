"""(b) End-to-end samples/s of dlrm_tiny and criteo_kaggle (rows capped) on 2 local ranks, fp32 vs fp16
all-to-all; (c) the planner's predicted step time vs the measured one, for each of those runs.

Every run goes through mode=train's own entry (neocfg.contract.train): spawn 2 gloo ranks, train, evaluate. Each
model is planned once (fp32 all-to-all) and the fp16 run trains the same placement with only the all-to-all
precision changed, so the two differ in nothing else.

    .venv/bin/python bench/bench_e2e.py [--steps 60] [--rows-cap 100000] [--out e2e.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cap_rows, compose_cfg, emit, record_results  # noqa: E402

from neocfg.contract import load_or_make_plan, train as run  # noqa: E402
from neocfg.types import CommDtype  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dlrm_tiny,criteo_kaggle")
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--comm", default="fp32,fp16")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per precision, alternating; the fastest counts (other processes share the cores)")
    ap.add_argument("--record", action="store_true", help="write the result into bench/RESULTS.md")
    ap.add_argument("--out")
    a = ap.parse_args()
    runs, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            by_comm = {}
            cfg = compose_cfg([f"model={model}", *cap_rows(model, a.rows_cap), "mode=train",
                               f"train.steps={a.steps}", f"train.batch_size={a.batch}", "train.eval_batches=2",
                               f"train.log_every={a.steps}"])
            base_plan = load_or_make_plan(cfg)
            for comm in [c for _ in range(a.repeats) for c in a.comm.split(",")]:
                dtype = CommDtype(comm)
                plan = dataclasses.replace(base_plan, a2a_fwd_dtype=dtype, a2a_bwd_dtype=dtype)
                plan_file = Path(tmp) / f"{model}_{comm}_{len(runs)}.json"
                plan.save(plan_file)
                cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(plan_file)))
                m = run(cfg, Path(tmp) / f"{model}_{comm}_{len(runs)}")
                row = {k: getattr(m, k) for k in ("model", "world_size", "global_batch", "steps", "samples_per_s",
                                         "predicted_step_ms", "measured_step_ms", "prediction_error", "eval_auc",
                                         "breakdown_ms")}
                row["comm"] = comm
                row["shardings"] = sorted({t.sharding.value for t in plan.tables})
                runs.append(row)
                if comm not in by_comm or row["samples_per_s"] > by_comm[comm]["samples_per_s"]:
                    by_comm[comm] = row
            if "fp32" in by_comm and "fp16" in by_comm:
                summary[model] = {"samples_per_s_fp32": by_comm["fp32"]["samples_per_s"],
                                  "samples_per_s_fp16": by_comm["fp16"]["samples_per_s"],
                                  "fp16_over_fp32": by_comm["fp16"]["samples_per_s"]
                                  / by_comm["fp32"]["samples_per_s"]}
    emit({"bench": "end_to_end_2_ranks", "rows_cap": a.rows_cap, "steps": a.steps, "batch_per_rank": a.batch,
          "summary": summary,
          "predicted_vs_measured": [{"model": r["model"], "comm": r["comm"], "predicted_step_ms":
                                     r["predicted_step_ms"], "measured_step_ms": r["measured_step_ms"],
                                     "prediction_error": r["prediction_error"]} for r in runs],
          "runs": runs}, a.out)
    if a.record:
        record_results("End to end: fp32 vs fp16 all-to-all", "\n".join([
            f"2 ranks, batch {a.batch} per rank, {a.steps} steps, tables capped at {a.rows_cap:,} rows, best of "
            f"{a.repeats} runs per precision:", "",
            "| model | all-to-all | samples/s | predicted ms | measured ms | error |", "|---|---|---|---|---|---|",
            *(f"| {r['model']} | {r['comm']} | {r['samples_per_s']:,.0f} | {r['predicted_step_ms']:.2f} | "
              f"{r['measured_step_ms']:.2f} | {r['prediction_error']:+.0%} |" for r in runs)]))


if __name__ == "__main__":
    main()
