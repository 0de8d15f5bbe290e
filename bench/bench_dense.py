"""The dense part of a training step alone (bottom MLP, interaction, top MLP, BCE, backward with DDP's all-reduce,
optimizer step) on 2 gloo ranks, one thread each, per term, under the settings neocfg used before the fused dense path and the
ones it uses now; the pooled embeddings are a fixed random input that needs a gradient (as in training).

    .venv/bin/python bench/bench_dense.py [--model criteo] [--batch 512] [--steps 60] [--repeats 3] [--out x.json]

Variants, alternating step by step in the same processes (medians per term over the timed steps, then the median
over repeats):
  before: DDP with its defaults (buffers broadcast before every forward, gradients copied into and out of the
          all-reduce buckets), torch.optim.Adagrad with its CPU default (a loop over parameters);
  torch_gemm: the DDP and optimizer settings of now, the MLPs on torch's nn.Linear (MKL sgemm), as before the oneDNN layers;
  after:  what neocfg.runtime does now (neocfg.runtime.dlrm.DDP_OPTIONS and make_dense_optimizer: fused Adagrad;
          the MLPs' large layers as fused oneDNN matmuls, dlrm.MLP).
"""

from __future__ import annotations

import argparse
import dataclasses
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compose_cfg, emit, record_results  # noqa: E402

from neocfg.runtime import dlrm  # noqa: E402
from neocfg.runtime.launch import free_port  # noqa: E402
from neocfg.types import DenseOptimizer  # noqa: E402

WORLD, WARMUP = 2, 3
TERMS = ("forward", "backward", "optimizer", "total")


VARIANTS = ("before", "torch_gemm", "after")


def _build(cfg, variant: str):
    dense = dlrm.build_dense(cfg.model, 0, torch.device("cpu"), onednn=variant == "after")
    if variant == "before":
        ddp = DistributedDataParallel(dense)
        opt = torch.optim.Adagrad(ddp.parameters(), lr=0.05)
    else:
        ddp = DistributedDataParallel(dense, **dlrm.DDP_OPTIONS)
        opt = dlrm.make_dense_optimizer(ddp.parameters(), DenseOptimizer.adagrad, 0.05)
    return ddp, opt


def _worker(rank: int, port: int, cfg, batch: int, steps: int, variants: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, cfg.model.num_dense_features, generator=g)
    pooled_in = torch.randn(batch, sum(cfg.model.embedding_dims), generator=g)
    labels = (torch.rand(batch, generator=g) < 0.5).float()
    built = {v: _build(cfg, v) for v in variants}
    per = {v: {t: [] for t in TERMS} for v in variants}
    for s in range(steps):
        # variants alternate step by step (and which goes first), so load changes hit both alike
        for variant in (variants if s % 2 == 0 else variants[::-1]):
            ddp, opt = built[variant]
            pooled = pooled_in.clone().requires_grad_(True)
            t0 = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(ddp(x, pooled), labels)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if s >= WARMUP:
                for t, v in zip(TERMS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    per[variant][t].append(v * 1e3)
    result = {v: {t: statistics.median(x) for t, x in per[v].items()} for v in variants}
    if rank == 0:
        Path(out, "dense.json").write_text(json.dumps(result))
    dist.destroy_process_group()



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="criteo_kaggle")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="write the result into bench/RESULTS.md")
    ap.add_argument("--out")
    a = ap.parse_args()
    cfg = compose_cfg([f"model={a.model}"])
    reps = []
    for r in range(a.repeats):
        order = list(VARIANTS)
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(free_port(), cfg, a.batch, a.steps, order, out), nprocs=WORLD,
                               start_method="spawn")
            reps.append(json.loads(Path(out, "dense.json").read_text()))
        print(f"repeat {r + 1}/{a.repeats}: " + "; ".join(
            f"{v} " + ", ".join(f"{t} {reps[-1][v][t]:.2f}" for t in TERMS) for v in VARIANTS),
            file=sys.stderr)
    med = {v: {t: statistics.median(rep[v][t] for rep in reps) for t in TERMS} for v in VARIANTS}
    for t in TERMS:
        print(f"{t:>10}: before {med['before'][t]:7.2f} ms, torch_gemm {med['torch_gemm'][t]:7.2f} ms, after "
              f"{med['after'][t]:7.2f} ms ({med['before'][t] / med['after'][t]:.2f}x, "
              f"{med['torch_gemm'][t] / med['after'][t]:.2f}x)", file=sys.stderr)
    emit({"bench": "dense_part", "model": a.model, "world": WORLD, "batch_per_rank": a.batch, "steps": a.steps,
          "median_ms": med, "repeats": reps}, a.out)
    if a.record:
        record_results(f"Dense part alone ({a.model})", "\n".join([
            f"{WORLD} ranks, batch {a.batch} per rank, {a.steps} steps, median of {a.repeats} repeats, ms:", "",
            "| term | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS),
            *(f"| {t} | " + " | ".join(f"{med[v][t]:.2f}" for v in VARIANTS) + " |" for t in TERMS)]))


if __name__ == "__main__":
    main()
