"""Prediction error of the planner on this machine: models x per-rank batch sizes, repeated, medians.

Each point plans the model (the hardware preset and any extra overrides, e.g. the pre-calibration constants) and
trains it on 2 local ranks through mode=train's entry (neocfg.runtime.run.run), `--repeats` times; reports the
median measured step, the prediction, the error, and the terms side by side (the planner's embedding terms without
the dense part, which metrics.json's `predicted_vs_measured_ms` counts twice: device compute/comm include it).

    .venv/bin/python bench/prediction_error.py [--models dlrm_tiny,criteo_kaggle] [--batches 256,1024]
        [--repeats 3] [--steps 200] [--set hardware.collective_latency_us=0 ...] [--out err.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cap_rows, compose_cfg, emit  # noqa: E402

from neocfg.planner.costs import dense_cost  # noqa: E402
from neocfg.runtime.run import load_or_make_plan, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dlrm_tiny,criteo_kaggle")
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides (planning only)")
    ap.add_argument("--out")
    a = ap.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            for batch in (int(x) for x in a.batches.split(",")):
                cfg = compose_cfg([f"model={model}", *cap_rows(model, a.rows_cap), "mode=train",
                                   f"train.steps={a.steps}", f"train.batch_size={batch}", "train.eval_batches=0",
                                   f"train.log_every={a.steps}", *a.set])
                plan = load_or_make_plan(cfg)
                dense = dense_cost(cfg).perf
                plan_file = Path(tmp) / f"plan_{model}_{batch}.json"
                plan.save(plan_file)
                cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(plan_file)))
                runs = [run(cfg, Path(tmp) / f"run_{model}_{batch}_{i}") for i in range(a.repeats)]
                measured = statistics.median(m["measured_step_ms"] for m in runs)
                bd = {k: statistics.median(m["breakdown_ms"][k] for m in runs) for k in runs[0]["breakdown_ms"]}
                pred = plan.estimate.step_ms
                points.append({
                    "model": model, "batch_per_rank": batch, "predicted_step_ms": round(pred, 3),
                    "measured_step_ms_median": round(measured, 3),
                    "measured_step_ms_all": [round(m["measured_step_ms"], 3) for m in runs],
                    "prediction_error": round((measured - pred) / pred, 3),
                    "shardings": sorted({t.sharding.value for t in plan.tables}),
                    "terms_predicted_vs_measured_ms": {
                        "embedding_compute": [round(max(d.compute_ms for d in plan.devices) - dense.compute, 3),
                                              round(bd["emb_fwd"] + bd["emb_bwd"], 3)],
                        "embedding_comm": [round(max(d.comm_ms for d in plan.devices) - dense.comm, 3),
                                           round(bd["comm_input"] + bd["comm_fwd"] + bd["comm_bwd"], 3)],
                        "dense": [round(dense.total, 3), round(bd["dense"], 3)],
                        "data": [0.0, round(bd["data_wait"], 3)]}})
                print(points[-1], file=sys.stderr, flush=True)
    emit({"bench": "prediction_error", "overrides": a.set, "steps": a.steps, "repeats": a.repeats,
          "points": points}, a.out)


if __name__ == "__main__":
    main()
