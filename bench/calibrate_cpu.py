"""Measure this machine for the cpu_local hardware preset: gloo collective latency and bandwidth on 2 local ranks,
fused TBE (fbgemm, row-wise Adagrad) lookup bandwidth and per-call overhead, dense MLP training FLOP rate and
per-layer overhead. Prints the values to put in conf/hardware/cpu_local.yaml (medians of timed repeats).

    .venv/bin/python bench/calibrate_cpu.py [--repeats 50] [--out calib.json]

Each rank runs with one thread (as mode=train does on a 2-core machine: cpu_count // local ranks). Every quantity is
a fit of t = a + b x over two or more sizes (a: fixed cost, b: per byte or per FLOP), so the preset gets both the
latency-like and the throughput-like term. Run it on an otherwise idle machine; other jobs inflate both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The constants the preset is read against (neocfg.config.planner.CostConstants defaults).
HBM_EFFICIENCY = 0.5
BWD_COMPUTE_MULTIPLIER = 2.0
TRAIN_FLOPS_PER_FWD = 3
# Kernels (dispatched ops) per linear layer per training step: addmm + activation forward; two matmuls, the
# activation's gradient and the bias gradient backward; neocfg.planner.costs.DENSE_KERNELS_PER_LAYER.
KERNELS_PER_LAYER = 6
# Kernels of this MLP step outside its layers: the loss and its gradient seed, zero_grad, Adagrad's foreach update.
STEP_KERNELS = 10


def fit(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least-squares t = a + b x."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return mt - b * mx, b


def timed(fn, repeats: int, warmup: int = 5) -> float:
    """Median seconds of fn()."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


# ---------------------------------------------------------------- gloo collectives on 2 local ranks

COLL_BYTES = [64, 4096, 65536, 1 << 20, 4 << 20]   # bytes each rank sends in total


def _coll_worker(rank: int, world: int, init: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res: dict[str, list[float]] = {"all_to_all": [], "all_reduce": [], "reduce_scatter": [], "all_gather": []}
    for nbytes in COLL_BYTES:
        n = max(world, nbytes // 4 // world * world)
        x = torch.randn(n)
        y = torch.empty(n)
        small = torch.empty(n // world)
        big = torch.empty(n * world)

        def a2a():
            dist.all_to_all_single(y, x)

        def ar():
            dist.all_reduce(x)

        def rs():
            dist.reduce_scatter_single(small, x)

        def ag():
            dist.all_gather_single(big, x)

        for name, fn in (("all_to_all", a2a), ("all_reduce", ar), ("reduce_scatter", rs), ("all_gather", ag)):
            dist.barrier()
            res[name].append(timed(fn, repeats))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def collectives(repeats: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "coll.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_coll_worker, args=(2, init, repeats, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    fits = {}
    for name, ts in res.items():
        a, b = fit([float(x) for x in COLL_BYTES], ts)
        fits[name] = {"latency_us": ts[0] * 1e6, "fit_latency_us": a * 1e6,
                      "gbs": (1.0 / b / 1e9) if b > 0 else float("inf"),
                      "times_us": {str(x): t * 1e6 for x, t in zip(COLL_BYTES, ts)}}
    return fits


# ---------------------------------------------------------------- fused TBE lookups (one rank, one thread)

def tbe(repeats: int) -> dict[str, float]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    torch.set_num_threads(1)
    tables, dim, rows = 8, 16, 20_000                # dlrm_tiny-sized tables
    op = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, pooling_mode=PoolingMode.SUM)
    lookups, ts = [], []
    gen = torch.Generator().manual_seed(0)
    zipf = torch.arange(1, rows + 1, dtype=torch.float64) ** -1.05
    for bags in (64, 256, 1024, 2048):                 # bags per table: the runtime's lookups per rank
        n = bags * tables
        # Zipf-skewed ids like the synthetic data (zipf_alpha ~1.05): hot rows repeat within a batch
        idx = torch.multinomial(zipf, n, replacement=True, generator=gen)
        off = torch.arange(0, n + 1, dtype=torch.long)

        def step():
            out = op(idx, off)
            out.backward(torch.ones_like(out))

        ts.append(timed(step, repeats))
        lookups.append(n)
    fwd_bytes = [x * dim * 4.0 for x in lookups]
    a, b = fit(fwd_bytes, ts)
    # fwd+bwd = (1 + bwd_multiplier) x fwd bytes / (bandwidth x hbm_efficiency)
    eff_gbs = (1 + BWD_COMPUTE_MULTIPLIER) / b / 1e9
    return {"call_overhead_us_fwd_bwd": a * 1e6, "effective_lookup_gbs": eff_gbs,
            "hbm_bandwidth_gbs_for_preset": eff_gbs / HBM_EFFICIENCY,
            "times_us": {str(x): t * 1e6 for x, t in zip(lookups, ts)}}


# ---------------------------------------------------------------- dense MLP training (one rank, one thread)

def dense(repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    widths = [512, 512, 256, 64, 16]                     # criteo_kaggle's bottom MLP shape
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.Adagrad(net.parameters(), lr=0.01)
    fwd_flops = sum(2 * a * b for a, b in zip(widths, widths[1:]))
    n_layers = len(widths) - 1
    xs, ts = [], []
    for batch in (16, 64, 256, 1024):
        x = torch.randn(batch, widths[0])

        def step():
            opt.zero_grad(set_to_none=True)
            net(x).sum().backward()
            opt.step()

        ts.append(timed(step, repeats))
        xs.append(float(batch * fwd_flops * TRAIN_FLOPS_PER_FWD))
    a, b = fit(xs, ts)
    big = torch.randn(1024, 1024)
    t_mm = timed(lambda: big @ big, max(5, repeats // 5))
    return {"train_tflops": 1.0 / b / 1e12, "matmul_peak_tflops": 2 * 1024**3 / t_mm / 1e12,
            "overhead_us_per_step": a * 1e6, "kernel_overhead_us": a * 1e6 / (n_layers * KERNELS_PER_LAYER + STEP_KERNELS),
            "times_us": {str(int(x)): t * 1e6 for x, t in zip(xs, ts)}}


def _concurrent_worker(rank: int, part: str, repeats: int, out: str) -> None:
    res = {"tbe": tbe, "dense": dense}[part](repeats)
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def concurrent(part: str, repeats: int, ranks: int) -> dict[str, float]:
    """Run the measurement in `ranks` processes at once, as mode=train's local ranks share the cores; the mean of
    their fits (a rank computes while its peer does: the rates a training step sees)."""
    if ranks <= 1:
        return {"tbe": tbe, "dense": dense}[part](repeats)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, part)
        mp.spawn(_concurrent_worker, args=(part, repeats, out), nprocs=ranks, join=True)
        runs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    return {k: (sum(r[k] for r in runs) / ranks if not isinstance(runs[0][k], dict) else runs[0][k])
            for k in runs[0]}


def only(part: str, repeats: int) -> None:
    print(json.dumps({"collectives": collectives, "tbe": tbe, "dense": dense}[part](repeats), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    ap.add_argument("--only", choices=["collectives", "tbe", "dense"])
    ap.add_argument("--ranks", type=int, default=2, help="processes measuring TBE and dense at once (mode=train's)")
    a = ap.parse_args()
    if a.only:
        return only(a.only, a.repeats)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
           "load_avg_1m": os.getloadavg()[0], "ranks": a.ranks, "collectives": collectives(a.repeats),
           "tbe": concurrent("tbe", a.repeats, a.ranks), "dense": concurrent("dense", a.repeats, a.ranks)}
    c, t, d = res["collectives"], res["tbe"], res["dense"]
    res["preset"] = {
        "collective_latency_us": round(statistics.median(v["latency_us"] for v in c.values()), 1),
        "intra_node_bandwidth_gbs": round(c["all_to_all"]["gbs"], 3),
        "device.hbm_bandwidth_gbs": round(t["hbm_bandwidth_gbs_for_preset"], 3),
        "device.peak_tflops": round(d["train_tflops"], 4),
        "device.kernel_overhead_us": round(d["kernel_overhead_us"], 1),
        "tbe_call_overhead_us (fwd+bwd)": round(t["call_overhead_us_fwd_bwd"], 1),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
