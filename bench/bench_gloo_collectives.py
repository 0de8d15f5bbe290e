"""Why the row-wise tables' partial sums travel by all-to-all: gloo's reduce_scatter against an all-to-all of the
same bytes followed by the sum on arrival (what neocfg.runtime.dist.Comm.sum_scatter does), and all_gather_single,
side by side in one run on 2 gloo ranks of one thread each, interleaved, at the sizes of a row-wise exchange.

    python bench/bench_gloo_collectives.py [--floats 16384 131072 1048576] [--iters 200] [--rounds 3] [--record]

Prints per size the best-of-rounds milliseconds of each and the ratio reduce_scatter / (all-to-all + sum), writes
them as JSON (--out) and, with --record, as bench/RESULTS.md's section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import record_results  # noqa: E402
from neocfg.runtime.launch import free_port  # noqa: E402
WORLD = 2


def _rank(rank: int, port: int, sizes: list[int], iters: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    best: dict[int, dict[str, float]] = {}
    for n in sizes:
        x = torch.randn(WORLD, n)

        def reduce_scatter() -> torch.Tensor:
            got = torch.empty(n)
            dist.reduce_scatter_single(got, x.view(-1))
            return got

        def all_to_all_sum() -> torch.Tensor:
            got = torch.empty(WORLD, n)
            dist.all_to_all_single(got.view(-1), x.view(-1))
            return got.sum(0)

        def all_gather() -> torch.Tensor:
            got = torch.empty(WORLD, n)
            dist.all_gather_single(got.view(-1), x[rank].contiguous())
            return got

        assert torch.allclose(reduce_scatter(), all_to_all_sum())
        runs = {"reduce_scatter": reduce_scatter, "all_to_all_sum": all_to_all_sum, "all_gather": all_gather}
        ms = {name: float("inf") for name in runs}
        for _ in range(rounds):   # interleaved: each round times every collective once
            for name, fn in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                ms[name] = min(ms[name], (time.perf_counter() - t0) / iters * 1e3)
        best[n] = ms
    if rank == 0:
        Path(out).write_text(json.dumps({str(n): v for n, v in best.items()}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=int, nargs="+", default=[16384, 131072, 1048576],
                    help="float32 elements each rank keeps (the input is world times that)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="write bench/RESULTS.md's section")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "bench_gloo_collectives.json")
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(free_port(), a.floats, a.iters, a.rounds, str(a.out)), nprocs=WORLD, join=True)
    got = json.loads(a.out.read_text())
    rows = ["| floats kept per rank | input per rank | reduce_scatter | all_to_all + sum | all_gather | reduce_scatter / "
            "(all_to_all + sum) |", "|---:|---:|---:|---:|---:|---:|"]
    for n, ms in got.items():
        rows.append(f"| {int(n):,} | {WORLD * int(n) * 4 / 2**20:.2f} MiB | {ms['reduce_scatter']:.3f} ms | "
                    f"{ms['all_to_all_sum']:.3f} ms | {ms['all_gather']:.3f} ms | "
                    f"{ms['reduce_scatter'] / ms['all_to_all_sum']:.2f}x |")
    print("\n".join(rows))
    print(f"written to {a.out}")
    if a.record:
        record_results("gloo reduce-scatter vs all-to-all", "\n".join([
            f"{WORLD} gloo ranks of one thread each on this machine; each collective timed over {a.iters} calls, "
            f"best of {a.rounds} interleaved rounds. The row-wise tables' partial sums travel by the all-to-all and "
            f"the sum on CPU ranks (`train.partial_sums=auto`: neocfg.planner.strategies).", "", *rows]))


if __name__ == "__main__":
    main()
