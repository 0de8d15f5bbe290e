"""(c) The planner's predicted step time vs the measured one, over per-rank batch sizes, term by term.

Each point plans the model for that batch size (make_plan) and trains it on 2 local ranks through mode=train's
entry; metrics.json's `predicted_vs_measured_ms` pairs the cost model's terms with the measured breakdown.

    .venv/bin/python bench/bench_prediction.py [--model dlrm_tiny] [--batches 128,512,2048] [--out pred.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cap_rows, compose_cfg, emit  # noqa: E402

from neocfg.runtime.run import load_or_make_plan, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dlrm_tiny")
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--batches", default="128,512,2048")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out")
    a = ap.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in (int(x) for x in a.batches.split(",")):
            cfg = compose_cfg([f"model={a.model}", *cap_rows(a.model, a.rows_cap), "mode=train",
                               f"train.steps={a.steps}", f"train.batch_size={batch}", "train.eval_batches=0",
                               f"train.log_every={a.steps}"])
            plan = load_or_make_plan(cfg)
            plan_file = Path(tmp) / f"plan_{batch}.json"
            plan.save(plan_file)
            cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(plan_file)))
            m = run(cfg, Path(tmp) / f"run_{batch}")
            points.append({"batch_per_rank": batch, "predicted_step_ms": m["predicted_step_ms"],
                           "measured_step_ms": m["measured_step_ms"], "prediction_error": m["prediction_error"],
                           "terms_predicted_vs_measured_ms": m["predicted_vs_measured_ms"],
                           "shardings": sorted({t.sharding.value for t in plan.tables})})
    errors = [abs(p["prediction_error"]) for p in points if p["prediction_error"] is not None]
    emit({"bench": "predicted_vs_measured_step", "model": a.model, "world_size": 2, "points": points,
          "mean_abs_prediction_error": sum(errors) / len(errors) if errors else None}, a.out)


if __name__ == "__main__":
    main()
