"""The `prod_like` data pipeline autoscaling on Ray, from one worker.

    flock /work/cpu.lock .venv/bin/python bench/bench_dpp_autoscale.py [--record]

`dsi=prod_like` as shipped (dsi.autoscale on, its autoscale_factor, prefetch_splits and transforms) over a generated
dataset, on `dsi.backend=ray` (the run's own Ray, one master actor, worker actors), with the service limits a run
of it gets when its plan asks one worker (neocfg.data.dpp_source.service_limits): the service starts with 1 worker
and may grow to autoscale_factor of them. A simulated trainer (one client) needs --demand x one worker's rate; every
split costs the workers --split-cost-s more (a sleep, so that the result does not depend on free cores). Per 1 s
window: the trainer's stall fraction and the workers; the result is the stall over the last third of the run against
the master's target (AUTOSCALE_STALL_FRACTION). JSON to outputs/bench/bench_dpp_autoscale.json, drawn in
bench_dpp_autoscale.png; --record writes RESULTS.md's "DPP autoscaling on Ray (prod_like)".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_dpp import autoscale_run, drain_rate, plot_autoscale, say_autoscale  # noqa: E402
from bench.common import compose_cfg, record_results  # noqa: E402
from neocfg.data.dataset import Manifest, dataset_splits  # noqa: E402
from neocfg.data.dpp.ray_backend import leave_ray, start_local_ray  # noqa: E402
from neocfg.data.dpp_source import service_limits  # noqa: E402
from neocfg.data.parquet_gen import write_dataset  # noqa: E402

PLANNED_WORKERS = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--split-cost-s", type=float, default=0.1)
    ap.add_argument("--demand", type=float, default=3.0, help="the trainer's demand in units of one worker's rate")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "bench_dpp_autoscale.json")
    ap.add_argument("--record-from", type=Path, help="only write the section from this earlier run's JSON")
    args = ap.parse_args()
    if args.record_from:
        record(json.loads(args.record_from.read_text()), args.record_from.with_suffix(".png"))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_cfg(["dsi=prod_like", f"dsi.path={Path(tmp) / 'ds'}", f"dsi.num_samples={args.samples}"])
        if not cfg.dsi.autoscale:
            raise SystemExit("conf/dsi/prod_like.yaml does not turn dsi.autoscale on")
        write_dataset(cfg)
        directory = Path(cfg.dsi.path)
        splits = dataset_splits(directory, Manifest.load(directory), eval=False)
        limits = service_limits(cfg.dsi, PLANNED_WORKERS)
        start_local_ray(object_store_mb=256, namespace="neocfg-bench")
        try:
            per_worker = drain_rate(cfg, splits, 1, 1, args.split_cost_s, backend="ray").samples_per_s
            run = argparse.Namespace(autoscale_demand=args.demand, autoscale_seconds=args.seconds,
                                     split_cost_s=args.split_cost_s)
            res = autoscale_run(cfg, splits, run, per_worker, backend="ray", limits=limits)
        finally:
            leave_ray()
    res.update({"preset": "prod_like", "autoscale_factor": cfg.dsi.autoscale_factor,
                "min_workers": limits.min_workers, "max_workers": limits.max_workers,
                "per_worker_samples_per_s": per_worker, "met": res["final_stall_fraction"] < res["target_stall_fraction"]})
    say_autoscale(res, run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot_autoscale(res, png)
    print(f"results written to {args.out} and {png}")
    if args.record:
        record(res, png)


def record(r: dict, png: Path) -> None:
    w = r["windows"]
    per_s = ", ".join(f"{x['workers']}" for x in w)
    lines = [f"`dsi=prod_like` as shipped (autoscale on, autoscale_factor {r['autoscale_factor']:g}) on "
             f"`dsi.backend=ray` (the run's own Ray), planned for {PLANNED_WORKERS} worker: the master may scale "
             f"between {r['min_workers']} and {r['max_workers']} worker actors. One simulated trainer needs "
             f"{r['demand_workers']:g} x one worker's rate ({r['demand_samples_per_s']:,.0f} samples/s; one worker "
             f"drains {r['per_worker_samples_per_s']:,.0f} samples/s with {r['split_cost_s']} s of simulated cost "
             f"per split), for {len(w)} s.", "",
             "| | stall fraction | workers |", "|---|---|---|",
             f"| first second | {r['first_window_stall']:.1%} | {w[0]['workers'] if w else '-'} |",
             f"| last third of the run | {r['final_stall_fraction']:.2%} | {r['final_workers']} |", "",
             f"Target: stall under {r['target_stall_fraction']:.0%} (AUTOSCALE_STALL_FRACTION): "
             f"**{'met' if r['met'] else 'not met'}**; {r['workers_added']} workers added, {r['workers_retired']} "
             f"retired. Workers per second: {per_s}. Drawn in `outputs/bench/{png.name}` (written by the bench)."]
    record_results("DPP autoscaling on Ray (prod_like)", "\n".join(lines))


if __name__ == "__main__":
    main()
