"""DPP benchmark: column projection, worker scaling, and the data stall at the planned vs too few workers.

    .venv/bin/python bench/bench_dpp.py [--samples 65536] [--out outputs/bench/bench_dpp.json]

1. Projection: one worker's read + transform + batch over every training split, reading only the model's columns
   vs reading every column (the extra columns are ~3/4 of the stored bytes). Samples/s, MB/s read, ratio.
2. Scaling: a local DPP service with 1 and then 2 worker processes, one client draining batches as fast as it can;
   with the real (cheap) preprocessing, and with a simulated extra cost per split. The worker time per split shows
   whether the two workers had a core each (it doubles when they share one).
3. Stall: a simulated trainer that needs `--demand-workers` x one worker's rate (it sleeps batch/demand per step)
   pulls from 1 worker (too few) and from the planned count (sizing.workers_needed with dsi.headroom). Workers get a
   simulated extra cost per split (`--split-cost-s`, a sleep) so that the result does not depend on how many free
   cores the machine has; stall fraction = time waiting for data / wall time (after the first batch).
4. Local vs Ray: the same 2 workers as local processes and as Ray actors (a local Ray, one master actor), drained
   as fast as possible and feeding the same simulated trainer: samples/s and stall side by side (interleaved).
5. Autoscaling (dsi.autoscale): a local service starts with 1 worker under a trainer that needs
   `--autoscale-demand` x one worker's rate; the master adds workers while the trainer stalls. Stall fraction and
   workers per second are recorded; the result is the stall over the last third of the run against the master's
   target (AUTOSCALE_STALL_FRACTION). Drawn in bench_dpp_autoscale.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from neocfg.config.schema import NeocfgConfig, load, register  # noqa: E402
from neocfg.data.dataset import FeatureColumns, Manifest, dataset_splits  # noqa: E402
from neocfg.data.dpp.master import AUTOSCALE_STALL_FRACTION, ServiceLimits, ServiceSetup  # noqa: E402
from neocfg.data.dpp.client import EndOfData  # noqa: E402
from neocfg.data.dpp.progress import Task  # noqa: E402
from neocfg.data.dpp.service import DppService  # noqa: E402
from neocfg.data.dpp.sizing import workers_needed  # noqa: E402
from neocfg.data.dpp.worker import SplitReader, WorkerSpec  # noqa: E402
from neocfg.data.parquet_gen import write_dataset  # noqa: E402
from neocfg.data.transforms import bind  # noqa: E402

MB = 1e6


def config(path: Path, samples: int) -> NeocfgConfig:
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose("config", overrides=["dsi=parquet_local", f"dsi.path={path}", f"dsi.num_samples={samples}"])
    return load(raw)


def spec_of(cfg: NeocfgConfig) -> WorkerSpec:
    cols = FeatureColumns.for_model(cfg.model)
    return WorkerSpec(columns=cols, transforms=tuple(bind(cfg.dsi.transforms, cols)), batch_size=cfg.train.batch_size)


def bench_projection(cfg: NeocfgConfig, splits, reps: int) -> dict:
    out = {}
    for project in (True, False) * reps:  # interleaved so that machine load hits both alike
        reader = SplitReader(replace(spec_of(cfg), project=project))
        t0, rows, nbytes = time.perf_counter(), 0, 0
        for s in splits:
            r = reader.process(Task(epoch=0, split=s))
            rows += r.rows
            nbytes += r.bytes_read
        dt = time.perf_counter() - t0
        reader.close()
        key = "projected" if project else "all_columns"
        best = out.get(key)
        if best is None or rows / dt > best["samples_per_s"]:
            out[key] = {"samples_per_s": rows / dt, "mb_per_s": nbytes / dt / MB, "bytes_read": nbytes,
                        "bytes_per_sample": nbytes / rows}
    out["speedup"] = out["projected"]["samples_per_s"] / out["all_columns"]["samples_per_s"]
    out["bytes_ratio"] = out["all_columns"]["bytes_read"] / out["projected"]["bytes_read"]
    return out


def service(cfg: NeocfgConfig, splits, workers: int, *, epochs: int | None, split_cost_s: float = 0.0,
            backend: str = "local", limits: ServiceLimits | None = None) -> DppService:
    setup = ServiceSetup(splits=tuple(splits), spec=replace(spec_of(cfg), extra_split_s=split_cost_s), workers=workers,
                         seed=1, max_epochs=epochs,
                         limits=limits or ServiceLimits(prefetch_splits=cfg.dsi.prefetch_splits))
    if backend == "ray":
        from neocfg.data.dpp.ray_backend import RayDppService, RayOptions, WorkerResources

        opts = RayOptions(namespace="neocfg-bench", master_name=f"bench-{uuid.uuid4().hex[:8]}", owner=True,
                          resources=WorkerResources(cpus=RAY_WORKER_CPUS, memory_bytes=2**28))
        return DppService(setup, clients=[0], backend=RayDppService(setup, opts)).start()
    return DppService(setup).start()


# Ray worker actors ask this many CPUs each in the benchmark (the local Ray has os.cpu_count() CPUs): the same
# 2 workers as the local backend fit on a 2-core machine.
RAY_WORKER_CPUS = 0.5


def wait_ready(svc: DppService, workers: int) -> None:
    """Until every worker has started (spawning takes seconds): start-up is not throughput."""
    while svc.backend.workers_ready() < workers:
        time.sleep(0.05)


@dataclass(frozen=True)
class Drain:
    samples_per_s: float
    worker_ms_per_split: float  # busy time of a worker per split: grows when workers share too few cores


def drain_rate(cfg: NeocfgConfig, splits, workers: int, epochs: int, split_cost_s: float = 0.0,
               backend: str = "local") -> Drain:
    """What one client gets with `workers` workers, timed from the first batch (worker start-up excluded)."""
    svc = service(cfg, splits, workers, epochs=epochs, split_cost_s=split_cost_s, backend=backend)
    try:
        c = svc.clients[0]
        c.next_arrays()
        wait_ready(svc, workers)
        s0, t0, rows = svc.stats(), time.perf_counter(), 0
        while True:
            try:
                rows += c.next_arrays().rows
            except EndOfData:
                break
        dt, s1 = time.perf_counter() - t0, svc.stats()
        per_split = (s1.worker_busy_s - s0.worker_busy_s) / max(s1.splits_done - s0.splits_done, 1)
        return Drain(samples_per_s=rows / dt, worker_ms_per_split=1e3 * (per_split - split_cost_s))
    finally:
        svc.close()


def scaling(cfg: NeocfgConfig, splits, args: argparse.Namespace, split_cost_s: float) -> dict:
    best: dict[int, Drain] = {}
    epochs = args.epochs if not split_cost_s else 1
    for w in (1, 2) * args.reps:  # interleaved, best of reps: other load on the machine hits both alike
        d = drain_rate(cfg, splits, w, epochs, split_cost_s)
        if w not in best or d.samples_per_s > best[w].samples_per_s:
            best[w] = d
    return {"split_cost_s": split_cost_s, "one_worker": vars(best[1]), "two_workers": vars(best[2]),
            "ratio": best[2].samples_per_s / best[1].samples_per_s}


def stall_run(cfg: NeocfgConfig, splits, workers: int, demand: float, seconds: float, split_cost_s: float,
              backend: str = "local") -> dict:
    svc = service(cfg, splits, workers, epochs=None, split_cost_s=split_cost_s, backend=backend)
    try:
        c = svc.clients[0]
        c.next_arrays()  # start-up (spawning workers) is not a steady-state stall
        wait_ready(svc, workers)
        step_s = cfg.train.batch_size / demand
        waited0, t0, steps = c.wait_s, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            c.next_arrays()
            steps += 1
            time.sleep(step_s)  # the trainer's compute
        wall = time.perf_counter() - t0
        return {"workers": workers, "steps": steps, "stall_fraction": (c.wait_s - waited0) / wall,
                "achieved_samples_per_s": steps * cfg.train.batch_size / wall}
    finally:
        svc.close()


def local_vs_ray(cfg: NeocfgConfig, splits, args: argparse.Namespace, demand: float) -> dict:
    """The same 2 workers as local processes and as Ray actors: drain rate and stall under the same trainer."""
    from neocfg.data.dpp.ray_backend import leave_ray, start_local_ray

    start_local_ray(object_store_mb=256, namespace="neocfg-bench")
    try:
        out: dict = {"workers": 2, "split_cost_s": args.split_cost_s, "demand_samples_per_s": demand}
        for backend in ("local", "ray") * args.reps:  # interleaved, best of reps
            d = drain_rate(cfg, splits, 2, 1, args.split_cost_s, backend=backend)
            st = stall_run(cfg, splits, 2, demand, args.stall_seconds, args.split_cost_s, backend=backend)
            best = out.get(backend)
            if best is None or d.samples_per_s > best["samples_per_s"]:
                out[backend] = {"samples_per_s": d.samples_per_s, "stall_fraction": st["stall_fraction"],
                                "achieved_samples_per_s": st["achieved_samples_per_s"]}
        out["ray_over_local"] = out["ray"]["samples_per_s"] / out["local"]["samples_per_s"]
        return out
    finally:
        leave_ray()


def autoscale_run(cfg: NeocfgConfig, splits, args: argparse.Namespace, per_worker: float,
                  backend: str = "local", limits: ServiceLimits | None = None) -> dict:
    """One worker to start with, a trainer that needs several: stall and workers per 1 s window. `limits`: the
    service's (default: autoscaling from 1 to --autoscale-max workers)."""
    limits = limits or ServiceLimits(prefetch_splits=cfg.dsi.prefetch_splits, autoscale=True,
                                     max_workers=args.autoscale_max, min_workers=1)
    demand = args.autoscale_demand * per_worker
    svc = service(cfg, splits, 1, epochs=None, split_cost_s=args.split_cost_s, limits=limits, backend=backend)
    windows = []
    try:
        c = svc.clients[0]
        c.next_arrays()
        wait_ready(svc, 1)
        step_s = cfg.train.batch_size / demand
        t0 = last_t = time.perf_counter()
        last_wait = c.wait_s
        while time.perf_counter() - t0 < args.autoscale_seconds:
            c.next_arrays()
            time.sleep(step_s)
            now = time.perf_counter()
            if now - last_t >= 1.0:
                s = svc.stats()
                windows.append({"t": now - t0, "stall_fraction": (c.wait_s - last_wait) / (now - last_t),
                                "workers": s.workers})
                last_t, last_wait = now, c.wait_s
        stats = svc.stats()
    finally:
        svc.close()
    tail = windows[-max(1, len(windows) // 3):]
    return {"backend": backend, "demand_samples_per_s": demand, "demand_workers": args.autoscale_demand,
            "split_cost_s": args.split_cost_s, "target_stall_fraction": AUTOSCALE_STALL_FRACTION,
            "first_window_stall": windows[0]["stall_fraction"] if windows else None,
            "final_stall_fraction": sum(w["stall_fraction"] for w in tail) / len(tail) if tail else None,
            "final_workers": tail[-1]["workers"] if tail else None,
            "workers_added": stats.workers_added, "workers_retired": stats.workers_retired, "windows": windows}


def autoscale_ray(cfg: NeocfgConfig, splits, args: argparse.Namespace, per_worker: float) -> dict:
    """The same autoscaling run with Ray worker actors (a local Ray for the run); `per_worker` is a local worker's
    rate (the simulated cost per split dominates both)."""
    from neocfg.data.dpp.ray_backend import leave_ray, start_local_ray

    start_local_ray(object_store_mb=256, namespace="neocfg-bench")
    try:
        return autoscale_run(cfg, splits, args, per_worker, backend="ray")
    finally:
        leave_ray()


def say_autoscale(a: dict, args: argparse.Namespace) -> dict:
    print(f"autoscale ({a['backend']}): trainer needs {args.autoscale_demand:g} x one worker; 1 worker at start: "
          f"stall {a['first_window_stall']:.1%} in the first second -> {a['final_stall_fraction']:.1%} over the last "
          f"third with {a['final_workers']} workers (target {a['target_stall_fraction']:.0%}; "
          f"{a['workers_added']} added, {a['workers_retired']} retired)")
    return a


def plot_autoscale(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = res["windows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([x["t"] for x in w], [x["stall_fraction"] for x in w], label="stall fraction", color="tab:red")
    ax.axhline(res["target_stall_fraction"], ls="--", color="tab:red", lw=0.8, label="target")
    ax.set_xlabel("seconds")
    ax.set_ylabel("stall fraction")
    ax2 = ax.twinx()
    ax2.step([x["t"] for x in w], [x["workers"] for x in w], where="post", color="tab:blue", label="workers")
    ax2.set_ylabel("DPP workers")
    ax.set_title(f"DPP autoscaling ({res['backend']}): trainer needs {res['demand_workers']:g} x one worker")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (best is kept) of projection and scaling runs")
    ap.add_argument("--epochs", type=int, default=6, help="epochs per scaling run")
    ap.add_argument("--split-cost-s", type=float, default=0.1, help="simulated extra cost per split (stall runs)")
    ap.add_argument("--demand-workers", type=float, default=1.5, help="trainer demand in units of one worker")
    ap.add_argument("--stall-seconds", type=float, default=6.0)
    ap.add_argument("--autoscale-demand", type=float, default=3.0, help="autoscaling run: demand in worker units")
    ap.add_argument("--autoscale-seconds", type=float, default=40.0)
    ap.add_argument("--autoscale-max", type=int, default=8)
    ap.add_argument("--no-ray", action="store_true", help="skip the local vs Ray comparison and Ray autoscaling")
    ap.add_argument("--only-autoscale", action="store_true", help="only the autoscaling runs (local, then Ray)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "bench_dpp.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(Path(tmp) / "ds", args.samples)
        write_dataset(cfg)
        directory = Path(cfg.dsi.path)
        splits = dataset_splits(directory, Manifest.load(directory), eval=False)
        res: dict = {"samples": args.samples, "splits": len(splits), "batch_size": cfg.train.batch_size}

        if not args.only_autoscale:
            res["projection"] = p = bench_projection(cfg, splits, args.reps)
            print(f"projection: {p['projected']['samples_per_s']:,.0f} samples/s "
                  f"({p['projected']['mb_per_s']:.1f} MB/s read) vs all columns "
                  f"{p['all_columns']['samples_per_s']:,.0f} samples/s ({p['all_columns']['mb_per_s']:.1f} MB/s) "
                  f"-> speed-up x{p['speedup']:.2f}, bytes read / {p['bytes_ratio']:.2f}")

            for key, cost in (("scaling", 0.0), ("scaling_simulated_cost", args.split_cost_s)):
                res[key] = r = scaling(cfg, splits, args, cost)
                one, two = r["one_worker"], r["two_workers"]
                label = "real preprocessing" if not cost else f"+{cost}s simulated per split"
                print(f"scaling ({label}): 1 worker {one['samples_per_s']:,.0f} samples/s, 2 workers "
                      f"{two['samples_per_s']:,.0f} samples/s -> x{r['ratio']:.2f} (worker busy ms per split "
                      f"{one['worker_ms_per_split']:.1f} -> {two['worker_ms_per_split']:.1f})")

        per_worker = drain_rate(cfg, splits, 1, 1, args.split_cost_s).samples_per_s
        if not args.only_autoscale:
            demand = args.demand_workers * per_worker
            planned = workers_needed(demand, per_worker, cfg.dsi.headroom)
            few = max(1, planned - 1) if planned > 1 else 1
            runs = {name: stall_run(cfg, splits, w, demand, args.stall_seconds, args.split_cost_s)
                    for name, w in (("too_few", few), ("planned", planned))}
            res["stall"] = {"split_cost_s": args.split_cost_s, "per_worker_samples_per_s": per_worker,
                            "demand_samples_per_s": demand, "headroom": cfg.dsi.headroom, **runs}
            print(f"stall: trainer demand {demand:,.0f} samples/s = {args.demand_workers} x one worker "
                  f"({per_worker:,.0f}/s with {args.split_cost_s}s simulated cost per split); planned "
                  f"{planned} workers (headroom {cfg.dsi.headroom}): stall {runs['planned']['stall_fraction']:.1%}; "
                  f"{few} worker(s): stall {runs['too_few']['stall_fraction']:.1%}")

            if not args.no_ray:
                res["local_vs_ray"] = lr = local_vs_ray(cfg, splits, args, demand)
                print(f"local vs Ray (2 workers, {args.split_cost_s}s simulated per split): drained "
                      f"{lr['local']['samples_per_s']:,.0f} vs {lr['ray']['samples_per_s']:,.0f} samples/s "
                      f"(Ray/local x{lr['ray_over_local']:.2f}); stall at {demand:,.0f} samples/s demand "
                      f"{lr['local']['stall_fraction']:.1%} vs {lr['ray']['stall_fraction']:.1%}")

        res["autoscale"] = a = autoscale_run(cfg, splits, args, per_worker)
        say_autoscale(a, args)
        if not args.no_ray:
            res["autoscale_ray"] = say_autoscale(autoscale_ray(cfg, splits, args, per_worker), args)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    for key in ("autoscale", "autoscale_ray"):
        if res.get(key, {}).get("windows"):
            plot_autoscale(res[key], args.out.with_name(f"{args.out.stem}_{key}.png"))
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
