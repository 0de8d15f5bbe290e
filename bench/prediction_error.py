"""Prediction error of the planner on this machine: models x per-rank batch sizes, repeated, medians.

Each point plans the model (the hardware preset and any extra overrides, e.g. the pre-calibration constants) and
trains it on 2 local ranks through mode=train's entry (neocfg.contract.train), `--repeats` times; reports the
median measured step, the prediction, the error, and metrics.json's terms side by side (embedding compute,
embedding communication, dense, data).

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

from neocfg.contract import load_or_make_plan, train as run  # noqa: E402


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
                plan_file = Path(tmp) / f"plan_{model}_{batch}.json"
                plan.save(plan_file)
                cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(plan_file)))
                runs = [run(cfg, Path(tmp) / f"run_{model}_{batch}_{i}") for i in range(a.repeats)]
                measured = statistics.median(m.measured_step_ms for m in runs)
                pred = plan.estimate.step_ms
                points.append({
                    "model": model, "batch_per_rank": batch, "predicted_step_ms": round(pred, 3),
                    "measured_step_ms_median": round(measured, 3),
                    "measured_step_ms_all": [round(m.measured_step_ms, 3) for m in runs],
                    "prediction_error": round((measured - pred) / pred, 3),
                    "shardings": sorted({t.sharding.value for t in plan.tables}),
                    # metrics.json's own term-by-term pairs: the planner's term, then the median measured one.
                    "terms_predicted_vs_measured_ms": {
                        term: [round(pair.predicted, 3),
                               round(statistics.median(m.predicted_vs_measured_ms[term].measured for m in runs), 3)]
                        for term, pair in runs[0].predicted_vs_measured_ms.items()}})
                print(points[-1], file=sys.stderr, flush=True)
    emit({"bench": "prediction_error", "overrides": a.set, "steps": a.steps, "repeats": a.repeats,
          "points": points}, a.out)


if __name__ == "__main__":
    main()
