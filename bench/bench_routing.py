"""Id routing at scale: one rank of a 128-rank plan of prod_856, batch 256, one CPU thread.

Times neocfg.runtime.routing.IdRouter per step on rank 0 (fastest of --reps calls, median beside it):
  route    the sender side (this rank's batch -> the payload for every destination, grouped by destination)
  receive  the receiver side (every source's payload for this rank -> the TBE groups' indices and offsets); the
           128 sources' batches are routed once beforehand (untimed) and only their part for this rank is kept
and, side by side in the same run, the per-piece loop the router replaced (`legacy_route`, the sender side of
neocfg before the vectorized router; --legacy-reps 0 skips it). Plans: every table table-wise (round robin), then the k largest
tables row-wise over all 128 ranks (k = 10, 50, 100 by default); then the sender side with 100 tables row-wise at
worlds 16..128, where the table pieces grow with the world and the ids do not. The receive side is timed on the
rank that receives the most ids (--receiver worst; or a rank number). Row-sharded ids travel in the encoding the
router is given for the plan (neocfg.planner.strategies.routing_encoding); --encodings lengths,codes times both
side by side instead, and --dtypes int32,int64 both id dtypes (default: the plan's, planner.strategies.id_dtype).
The process keeps freed memory as a training rank does (launch.keep_freed_memory).

    .venv/bin/python bench/bench_routing.py [--world 128] [--batch 256] [--rw 0,10,50,100] [--reps 10] [--out r.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compose_cfg, emit  # noqa: E402

from neocfg.batch import Batch  # noqa: E402
from neocfg.data.synthetic import SyntheticData  # noqa: E402
from neocfg.runtime.launch import keep_freed_memory  # noqa: E402
from neocfg.runtime.layout import Layout, build_layout  # noqa: E402
from neocfg.runtime.plans import rule_plan  # noqa: E402
from neocfg.planner.strategies import id_dtype, routing_encoding  # noqa: E402
from neocfg.runtime.routing import ID_DTYPES, IdRouter, RwEncoding  # noqa: E402
from neocfg.types import ShardingType  # noqa: E402


def legacy_route(layout: Layout, batch: Batch) -> int:
    """The sender side before the vectorized router: a Python loop over destinations x table pieces; each row-wise piece scans
    all of its table's ids. Returns the ids routed."""
    b = batch.batch_size
    values_all, lengths_all = batch.values.long(), batch.lengths.long()
    starts = [0]
    for n in lengths_all.sum(dim=1).tolist():
        starts.append(starts[-1] + n)
    sample_of: dict[int, torch.Tensor] = {}
    lengths, values = [], []
    for r in layout.ranks:
        for s in r.features:
            ids = values_all[starts[s.table]:starts[s.table + 1]]
            if s.row_offset == 0 and s.num_rows == layout.rows[s.table]:
                lengths.append(lengths_all[s.table])
                values.append(ids)
            else:
                if s.table not in sample_of:
                    sample_of[s.table] = torch.repeat_interleave(torch.arange(b), lengths_all[s.table])
                mask = (ids >= s.row_offset) & (ids < s.row_offset + s.num_rows)
                lengths.append(torch.bincount(sample_of[s.table][mask], minlength=b))
                values.append(ids[mask] - s.row_offset)
    torch.stack(lengths)
    return int(torch.cat(values).numel())


def _ms(fn, reps: int) -> tuple[float, float]:
    """(fastest, median) milliseconds of reps calls; the fastest is the least disturbed by other processes."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="prod_856")
    ap.add_argument("--world", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rw", default="0,10,50,100", help="numbers of largest tables made row-wise")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--legacy-reps", type=int, default=2)
    ap.add_argument("--scale-worlds", default="16,32,64,128",
                    help="worlds at which the sender side is timed with --scale-rw tables row-wise (pieces grow "
                         "with the world, the ids do not)")
    ap.add_argument("--scale-rw", type=int, default=100)
    ap.add_argument("--distinct-batches", type=int, default=8,
                    help="source ranks cycle through this many generated batches (generation is the slow part)")
    ap.add_argument("--receiver", default="worst", help="rank whose receive side is timed, or 'worst'")
    ap.add_argument("--encodings", default="auto", help="auto (the plan's choice) or a list of lengths,codes")
    ap.add_argument("--dtypes", default="auto", help="auto (the plan's choice) or a list of int32,int64")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    encodings = [None] if a.encodings == "auto" else [RwEncoding(e) for e in a.encodings.split(",")]
    dtypes = [None] if a.dtypes == "auto" else [getattr(torch, d) for d in a.dtypes.split(",")]
    model = compose_cfg([f"model={a.model}"]).model
    data = SyntheticData.for_model(model, seed=0)
    n = min(a.distinct_batches, a.world)
    print(f"generating {n} batches of {a.batch} ({len(model.tables)} tables) ...", file=sys.stderr)
    distinct = [data.batch(r * a.batch, a.batch) for r in range(n)]
    batches = [distinct[r % n] for r in range(a.world)]
    largest = sorted(range(len(model.tables)), key=lambda i: -model.tables[i].num_embeddings)
    rows = []
    for k in [int(x) for x in a.rw.split(",")]:
        rw = {model.tables[i].name for i in largest[:k]}
        sharding = {t.name: ShardingType.row_wise if t.name in rw else ShardingType.table_wise for t in model.tables}
        plan = rule_plan(model, world=a.world, devices_per_node=min(8, a.world), batch_size=a.batch,
                         sharding=sharding)
        layouts = [build_layout(plan, model, r) for r in range(a.world)]
        pieces = sum(len(t.shards) for t in plan.tables)
        for enc, dt in [(e, d) for e in encodings for d in dtypes]:
            enc = enc or routing_encoding(plan, model)
            dt = dt or ID_DTYPES[id_dtype(plan, a.batch)]
            routers = [IdRouter(lay, a.batch, torch.device("cpu"), enc, dt) for lay in layouts]
            # what every rank receives from every source (their routing is untimed setup)
            routed = [router.route(bt) for router, bt in zip(routers, batches)]
            ids_to = torch.stack([r.counts[:, 0] for r in routed]).sum(dim=0)       # ids each rank receives
            dest = int(ids_to.argmax()) if a.receiver == "worst" else int(a.receiver)
            recv_parts, recv_counts = [], []
            for r, router in zip(routed, routers):
                recv_parts.append(r.payload.split(router.send_sizes(r.counts).tolist())[dest].clone())
                recv_counts.append(r.counts[dest])
            del routed
            recv, counts = torch.cat(recv_parts), torch.stack(recv_counts)
            me, them = routers[0], routers[dest]
            route_ms, route_med = _ms(lambda: me.route(batches[0]), a.reps)
            receive_ms, receive_med = _ms(lambda: them.receive(recv, counts, int(counts[:, 1].sum())), a.reps)
            legacy_ms = (_ms(lambda: legacy_route(layouts[0], batches[0]), a.legacy_reps)[0]
                         if a.legacy_reps and enc is encodings[0] and dt is dtypes[0] else None)
            row = {"row_wise_tables": k, "table_pieces_in_world": pieces, "encoding": me.encoding.value,
                   "dtype": str(me.dtype).removeprefix("torch."),
                   "ids_sent": int(batches[0].values.numel()), "receiver": dest,
                   "ids_received": int(counts[:, 0].sum()), "ids_received_median_rank": int(ids_to.median()),
                   "route_ms": route_ms, "route_median_ms": route_med, "receive_ms": receive_ms,
                   "receive_median_ms": receive_med, "legacy_route_ms": legacy_ms,
                   "route_speedup_vs_legacy": (legacy_ms / route_ms) if legacy_ms else None}
            rows.append(row)
            print(f"rw={k:4d} pieces={pieces:6d} {me.encoding.value:7s} {row['dtype']} route {route_ms:7.2f} ms  receive (rank "
                  f"{dest}, {row['ids_received']:,} ids; median rank {row['ids_received_median_rank']:,}) "
                  f"{receive_ms:7.2f} ms  legacy route "
                  f"{legacy_ms if legacy_ms is not None else float('nan'):8.1f} ms", file=sys.stderr)
    scaling = []
    rw = {model.tables[i].name for i in largest[:a.scale_rw]}
    sharding = {t.name: ShardingType.row_wise if t.name in rw else ShardingType.table_wise for t in model.tables}
    for w in [int(x) for x in a.scale_worlds.split(",") if x]:
        plan = rule_plan(model, world=w, devices_per_node=min(8, w), batch_size=a.batch, sharding=sharding)
        router = IdRouter(build_layout(plan, model, 0), a.batch, torch.device("cpu"), routing_encoding(plan, model),
                          ID_DTYPES[id_dtype(plan, a.batch)])
        route_ms, route_med = _ms(lambda: router.route(batches[0]), a.reps)
        pieces = sum(len(t.shards) for t in plan.tables)
        scaling.append({"world": w, "row_wise_tables": a.scale_rw, "table_pieces_in_world": pieces,
                        "encoding": router.encoding.value, "route_ms": route_ms, "route_median_ms": route_med})
        print(f"world={w:4d} rw={a.scale_rw} pieces={pieces:6d} {router.encoding.value} route {route_ms:7.2f} ms",
              file=sys.stderr)
    emit({"model": a.model, "world": a.world, "batch": a.batch, "threads": 1, "rank": 0, "rows": rows,
          "world_scaling": scaling}, a.out)


if __name__ == "__main__":
    main()
