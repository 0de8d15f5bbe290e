"""Fit cpu_local's per-term constants from whole mode=train runs: the laps of a training step, where every term is
measured as the estimate prices it (2 gloo ranks at once, one thread each, the prefetch thread on the rank's core).

Micro-benchmarks of one part alone (calibrate_cpu.py's other parts) miss what a step adds: the other rank and the
gloo threads on the same cores, caches shared with the dense part, the prefetch thread. Here a few calibration models
(none of them bench/estimate_terms.py's) are trained by the real CLI, and each term's laps are fitted, by least
squares over the runs (and over the ranks, for the per-rank embedding laps), to the features the cost model prices:

  embedding compute (emb_fwd + emb_bwd, per rank)  = tbe_us_per_group x groups + tbe_ns_per_bag x bags
                                                     + tbe_ns_per_bag_column x bags x their columns
                                                     + tbe_ns_per_row x distinct rows looked up
                                                     + tbe_ns_per_far_line x their 64-byte lines, those of pieces
                                                       spanning more than table_reach_mib (x 1 - the reach / the span)
                                                     + rows' bytes / (hbm_bandwidth_gbs x hbm_efficiency) x 3
                                                       (the Zipf head's at cache_bandwidth_gbs)
  data (the prefetch lap, ids exchanged in the step) = synthetic_us_per_batch + synthetic_us_per_sample x B
                                                     + synthetic_ns_per_bag x bags + synthetic_ns_per_id x ids,
                                                       each count scaled as count ** synthetic_exponent
  ids exchanged in the step (table-wise runs: the comm_input lap, the router's pass and the pipelined id exchange)
                                                   = a per-step part (the collective's) + routing_ns_per_id x ids
  data, ids exchanged in the prefetch thread (row-wise runs), less the generation fitted above
                                                   = routing_us_per_step + (routing_ns_per_id fitted above
                                                     + routing_ns_per_row_id) x ids received
  dense (the dense lap)                            = dense_fixed_us + train FLOPs / (peak x mfu)
                                                     + dense_activation_passes x activation bytes / stream bandwidth
                                                     + DDP's exposed all-reduce (runs that sync by DDP; reported)
  the output exchange (comm_fwd + comm_bwd, per rank, less its kernels as priced; runs whose all-to-all travels
  behind the bottom MLP left out, unless hardware.output_overlap_efficiency is 0)
                                                   = all-to-alls x collective_latency_us + reduce-scatters and
                                                     all-gathers x reduce_scatter_latency_us + bytes / (the link's
                                                     rate, then exchange_copy_gbs for the host copies around it;
                                                     gather_copy_gbs for the reduce-scatters' and all-gathers')
                                                     + ddp_exchange_wait_us where DDP syncs the dense gradients
                                                     + exchange_ns_per_bag x the bags the outputs carry

    .venv/bin/python bench/calibrate_cpu.py --only step_terms [--out runs.json]
    .venv/bin/python bench/calibrate_step.py [--runs c1_tw,c2_rw] [--out runs.json] [--fit runs.json ...]
        [--quiet 0.15] [--passes 6.83] [--exponent 0.9]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compose_cfg  # noqa: E402
from estimate_terms import Kind, train_undisturbed  # noqa: E402

from neocfg.plan import Plan  # noqa: E402
from neocfg.planner.costs import (FP32, TRAIN_FLOPS_PER_FWD, CostModel, ddp_allreduce_ms,  # noqa: E402
                                  dense_activations, dense_cost, dense_flops_and_params, dense_layers, rider_bytes,
                                  row_lines, scaled_items, zipf_hit_rate)
from neocfg.sharding import SCHEMES, embedding_collectives, gather_collectives  # noqa: E402
from neocfg.sharding.collectives import Carries  # noqa: E402
from neocfg.types import DenseGradSync, IdsExchange  # noqa: E402

DIM = 16
DDP, EXCHANGE = "train.dense_grad_sync=ddp", "train.dense_grad_sync=exchange"
# Latencies of one DDP bucket all-reduce tried by the dense fit, microseconds (gloo's small all-reduce alone on a
# quiet box takes ~110 us; a collective waiting for a late peer in a step ~1.35 ms, the data-parallel tables'
# all-reduce in a step 3.4 ms: hardware.all_reduce_latency_us).
DDP_LATENCY_US = (0.0, 50.0, 100.0, 200.0, 300.0, 400.0, 600.0, 800.0, 1200.0, 1600.0, 2000.0, 2400.0, 2800.0,
                  3200.0, 3600.0, 4000.0)
# The pooling factors of cal_spread's tables, in turn.
SPREAD_POOLING = (1, 1, 2, 3, 1, 5, 2, 8, 1, 20, 3, 60)
# Exponents of the batch's ids and bags tried by the data fit (costs.scaled_items; 1: linear).
SYNTHETIC_EXPONENTS = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
# Sizes of a rank's processor cache tried by the compute fit, MiB (the per-rank share of an L3 of a few to tens of MiB).
CACHE_MIB = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# Spans of one table's rows tried as the device's table reach, MiB (beyond it a distinct row costs more: the 4 KiB
# pages' translations and the 2 MiB L2 of one core hold a few MiB of rows).
REACH_MIB = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def _model(name: str, tables: int, rows: int, pooling: float, bottom: list[int], top: list[int],
           interaction: str = "dot", alpha: float = 0.0, dim: int = DIM, **extra) -> dict:
    return {"name": name, "num_dense_features": 13, "bottom_mlp": bottom, "top_mlp": top, "interaction": interaction,
            "tables": [{"name": f"c{i}", "num_embeddings": rows, "embedding_dim": dim, "pooling_factor": pooling,
                        "zipf_alpha": alpha} for i in range(tables)], **extra}


@dataclass(frozen=True)
class CalRun:
    kind: Kind
    sharding: str
    batch: int


def _both(name: str, model: dict, steps: int, extra: tuple[str, ...] = (), batch: int = 256) -> dict[str, CalRun]:
    """The model's table-wise and row-wise calibration runs, named NAME_tw and NAME_rw."""
    kind = Kind(name, model, steps=steps, extra=extra)
    return {f"{name}_tw": CalRun(kind, "table_wise", batch), f"{name}_rw": CalRun(kind, "row_wise", batch)}


def _runs() -> dict[str, CalRun]:
    few = _model("cal_few", 10, 20_000, 3, [32, DIM], [32, 1])
    many = _model("cal_many", 60, 20_000, 8, [32, DIM], [64, 1])
    wide = _model("cal_wide", 300, 10_000, 15, [64, DIM], [128, 1], "dcn", dcn_low_rank_dim=16, dcn_num_layers=1)
    mlp = _model("cal_mlp", 26, 20_000, 1, [512, 256, DIM], [1024, 512, 256, 1])
    deep = _model("cal_deep", 400, 10_000, 25, [64, DIM], [64, 1], "dcn", dcn_low_rank_dim=16, dcn_num_layers=1)
    # the same with Zipf-skewed ids (the generator's inverse-CDF path instead of the uniform one)
    skewed = {**deep, "name": "cal_skewed", "tables": [{**t, "zipf_alpha": 1.1} for t in deep["tables"]]}
    # other dims (the TBE's work per bag and per row grows with the columns): 8, 32 and 64
    few32 = _model("cal_few32", 10, 20_000, 3, [32, 32], [32, 1], dim=32)
    many8 = _model("cal_many8", 60, 20_000, 8, [32, 8], [64, 1], dim=8)
    mid64 = _model("cal_mid64", 20, 100_000, 2, [64, 64], [64, 1], alpha=0.8, dim=64)
    # large tables (51 MB each): rows the processor caches do not hold
    big32 = _model("cal_big32", 8, 400_000, 4, [64, 32], [64, 1], dim=32)
    # wide rows of large skewed tables (256 MB each) at low pooling: the per-column and far-row work beside few ids
    big64 = _model("cal_big64", 8, 1_000_000, 2, [64, 64], [64, 1], alpha=1.1, dim=64)
    # the same rows drawn uniformly: nearly every id a distinct far row (its first fetch: four 64-byte lines)
    big64u = {**big64, "name": "cal_big64u", "tables": [{**t, "zipf_alpha": 0.0} for t in big64["tables"]]}
    # many distinct wide rows: 60 uniform tables of 300k rows x dim 32 at pooling 8 (priced per far row whatever its
    # width, uniform dim-32 rows read their compute a third low)
    wide32u = _model("cal_wide32u", 60, 300_000, 8, [64, 32], [64, 1], "dcn", dim=32, dcn_low_rank_dim=16,
                     dcn_num_layers=1)
    # pooling spread over the tables, heavy-tailed (most bags short, most ids in a few long ones), skewed ids
    spread = _model("cal_spread", 200, 20_000, 1, [64, DIM], [64, 1], "dcn", alpha=0.9, dcn_low_rank_dim=16,
                    dcn_num_layers=1)
    spread["tables"] = [{**t, "pooling_factor": SPREAD_POOLING[i % len(SPREAD_POOLING)]}
                        for i, t in enumerate(spread["tables"])]
    return {
        "few_tw": CalRun(Kind("few", few, steps=200), "table_wise", 256),
        "few_tw_1024": CalRun(Kind("few", few, steps=100), "table_wise", 1024),
        "few_rw": CalRun(Kind("few", few, steps=200), "row_wise", 256),
        **_both("many", many, 60), **_both("mlp", mlp, 60, batch=512),
        # (the many-id models at 30 steps too: with 8, the prefetch lap of deep_tw read 19.5 ms against 30.5 at 30,
        # wide_tw's 11.1 against 15.0: a short run's few timed steps hold the pipeline's start and end)
        **_both("wide", wide, 30, ("planner.time_limit_s=10",)), **_both("deep", deep, 30, ("planner.time_limit_s=10",)),
        "skewed_tw": CalRun(Kind("skewed", skewed, steps=30, extra=("planner.time_limit_s=10",)), "table_wise", 256),
        **_both("few32", few32, 200), **_both("many8", many8, 60), **_both("mid64", mid64, 60),
        **_both("big32", big32, 100), **_both("big64", big64, 100),
        "big64u_tw": CalRun(Kind("big64u", big64u, steps=100), "table_wise", 256),
        **_both("wide32u", wide32u, 30, ("planner.time_limit_s=10",)),
        # the batch's part of each term: the same models at 4x and 2x the batch
        "many_tw_1024": CalRun(Kind("many", many, steps=30), "table_wise", 1024),
        "many_rw_1024": CalRun(Kind("many", many, steps=30), "row_wise", 1024),
        "many_tw_512": CalRun(Kind("many", many, steps=30), "table_wise", 512),
        "many8_tw_1024": CalRun(Kind("many8", many8, steps=30), "table_wise", 1024),
        "few_rw_1024": CalRun(Kind("few", few, steps=100), "row_wise", 1024),
        "wide_tw_512": CalRun(Kind("wide", wide, steps=30, extra=("planner.time_limit_s=10",)), "table_wise", 512),
        "wide_rw_512": CalRun(Kind("wide", wide, steps=30, extra=("planner.time_limit_s=10",)), "row_wise", 512),
        **_both("spread", spread, 30, ("planner.time_limit_s=10",)),
        # the dense gradients' sync pinned against what auto picks (DDP for mlp and wide, the exchange for few and
        # many): the dense lap alone (exchange) beside it with DDP's exposed all-reduce
        "few_tw_ddp": CalRun(Kind("few", few, steps=200, extra=(DDP,)), "table_wise", 256),
        "many_tw_ddp": CalRun(Kind("many", many, steps=60, extra=(DDP,)), "table_wise", 256),
        "mlp_tw_x": CalRun(Kind("mlp", mlp, steps=60, extra=(EXCHANGE,)), "table_wise", 512),
        "wide_tw_x": CalRun(Kind("wide", wide, steps=30, extra=("planner.time_limit_s=10", EXCHANGE)), "table_wise",
                            256),
    }


def run_names() -> list[str]:
    return list(_runs())


def measure(names: list[str], retries: int = 2) -> list[dict]:
    """Train each calibration run by the CLI; its laps per rank and the plan it ran."""
    runs = _runs()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "conf"
        (conf / "model").mkdir(parents=True)
        for r in runs.values():
            (conf / "model" / f"{r.kind.model['name']}.yaml").write_text(yaml.safe_dump(r.kind.model, sort_keys=False))
        for name in names:
            r = runs[name]
            got = train_undisturbed(r.kind, r.sharding, conf, Path(tmp) / name, [f"train.batch_size={r.batch}"],
                                    retries)
            m, run_dir = got.metrics, got.run_dir
            out.append({"name": name, "model": r.kind.model, "batch": r.batch, "extra": list(r.kind.extra),
                        "others": got.others, "breakdown": m.breakdown_ms,
                        "per_rank": m.breakdown_ms_per_rank,
                        "plan": json.loads((run_dir / "plan.json").read_text())})
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.breakdown_ms.items()), file=sys.stderr,
                  flush=True)
    return out


def _cfg(run: dict):
    d = Path(tempfile.mkdtemp()) / "model"
    d.mkdir(parents=True)
    (d / f"{run['model']['name']}.yaml").write_text(yaml.safe_dump(run["model"], sort_keys=False))
    return compose_cfg([f"model={run['model']['name']}", "hardware=cpu_local", f"train.batch_size={run['batch']}",
                        f"hydra.searchpath=[file://{d.parent}]"])


def features(run: dict) -> dict:
    """What the cost model prices for this run: per rank (groups, bags, rows' bytes, ids received), per run (the
    batch's bags and ids, dense kernels, FLOPs, activation bytes, DDP's all-reduce as priced)."""
    cfg = _cfg(run)
    cost = CostModel.from_config(cfg)
    plan = Plan.from_dict(run["plan"])
    world, b = plan.world_size, cfg.train.batch_size
    ranks = [{"groups": set(), "bags": 0.0, "bag_cols": 0.0, "distinct": 0.0, "spans": [], "bytes": 0.0, "ids": 0.0,
              "pieces": 0, "out_bytes": 0.0, "lookups": []}
             for _ in range(world)]
    for t in cfg.model.tables:
        tp = plan.table(t.name)
        k = len(tp.shards) if SCHEMES[tp.sharding].sliced else 1
        shape = cost.shape(t, tp.sharding, k)
        for s in tp.shards:
            r = ranks[s.rank]
            r["groups"].add((tp.weights_dtype, tp.memory))
            r["bags"] += shape.output_samples
            r["bag_cols"] += shape.output_samples * shape.cols
            r["distinct"] += cost.distinct_rows(t, shape)
            r["spans"].append((cost.distinct_rows(t, shape), shape.rows * shape.cols * tp.weights_dtype.bytes,
                               shape.cols * tp.weights_dtype.bytes))
            r["bytes"] += shape.lookup_rows * shape.cols * tp.weights_dtype.bytes
            r["lookups"].append((shape.lookup_rows * shape.cols * tp.weights_dtype.bytes, t.num_embeddings, t.alpha))
            r["ids"] += shape.lookup_rows
            r["pieces"] += 1
            # outputs out, gradients back (fp32): twice the gradients' records
            r["out_bytes"] += 2 * sum(pc.held_bytes for pc in cost.piece_comms(t, tp.sharding, shape)
                                      if pc.carries is Carries.output_grads)
    flops, params = dense_flops_and_params(cfg.model)
    c = cfg.planner.costs
    sync = plan.strategies.dense_grad_sync
    backward = dense_cost(cfg).perf.bwd_compute
    # DDP's exposed all-reduce (priced after the backward as the preset prices it) at each latency tried
    ddp = {us: ddp_allreduce_ms(cfg, backward, us) if sync is DenseGradSync.ddp else 0.0 for us in DDP_LATENCY_US}
    # the output exchange's collectives by kind (ids none: counted apart), and whether its all-to-all travels behind
    # the bottom MLP (the plan's strategy; runs of a runtime before it was one: DDP-synced with an all-to-all)
    shardings = {tp.sharding for tp in plan.tables}
    outputs = embedding_collectives(shardings, 0, world, cfg.hardware.devices_per_node)
    gathers = gather_collectives(shardings, world, cfg.hardware.devices_per_node)
    overlap = getattr(plan.strategies, "output_overlap", None)
    if overlap is None:
        overlap = sync is DenseGradSync.ddp and outputs > gathers
    # (a preset whose bottom MLP hides none of it, hardware.output_overlap_efficiency 0, prices it whole: kept)
    overlap = overlap and cfg.hardware.output_overlap_efficiency > 0
    return {"ranks": [{**r, "groups": len(r["groups"])} for r in ranks], "batch": b, "world": world,
            "weights": sum(t.num_embeddings * t.embedding_dim * FP32 for t in cfg.model.tables),
            "bags": b * len(cfg.model.tables), "ids": b * sum(t.pooling_factor for t in cfg.model.tables),
            "prefetch_ids": plan.strategies.ids_exchange is IdsExchange.prefetch,
            "train_flops": flops * b * TRAIN_FLOPS_PER_FWD, "act_bytes": dense_activations(cfg.model) * FP32 * b,
            "ddp": ddp, "riders": rider_bytes(cfg, sync), "a2a_collectives": outputs - gathers,
            "ddp_waits": int(sync is DenseGradSync.ddp and outputs > 0 and not overlap),
            "gather_collectives": gathers, "overlap": bool(overlap), "exchange_kernels_ms": c.embedding_step_kernels * cost.kernel_overhead_ms,
            "exchange_ms_per_byte": cost.a2a_ms_per_byte() + cost.exchange_copy_ms_per_byte,
            "link_ms_per_byte": cost.a2a_ms_per_byte(),
            "gather_ms_per_byte": cost.reduce_scatter_ms_per_byte() + cost.gather_copy_ms_per_byte,
            "gather_link_ms_per_byte": cost.reduce_scatter_ms_per_byte(),
            "shard_overhead_ms": c.shard_overhead_us / 1e3 * (1 + c.bwd_compute_multiplier),
            "hbm_efficiency": c.hbm_efficiency, "routing_ns_per_id": cfg.hardware.device.routing_ns_per_id, "bwd_multiplier": c.bwd_compute_multiplier,
            "stream_gbs": cfg.hardware.device.stream_bandwidth_gbs or cfg.hardware.device.hbm_bandwidth_gbs}


def _fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of the relative error (each run counts alike, whatever its size), non-negative: a feature whose
    coefficient comes out negative is dropped (0) and the rest refitted."""
    x, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[keep] = coef
    return [float(v) for v in full]


def fit(runs: list[dict], passes: float | None = None, exponent: float | None = None) -> dict:
    """The constants (cpu_local.yaml's units) and, per term, each run's measured / fitted ratio. passes: hold
    planner.costs.dense_activation_passes (a planner constant every preset shares) at this value in the dense fit;
    exponent: hold host.synthetic_exponent at this value (else the one of SYNTHETIC_EXPONENTS that fits best)."""
    feats = {r["name"]: features(r) for r in runs}
    any_f = next(iter(feats.values()))
    ratios: dict[str, list[str]] = {}

    def check(term: str, name: str, measured: float, fitted: float) -> None:
        ratios.setdefault(term, []).append(f"{name} {measured:.2f}/{fitted:.2f}")

    # embedding compute, per rank: groups, bags, bags' columns, distinct rows, those of pieces spanning beyond the
    # table reach (times the share beyond it), rows' bytes served by the processor cache and the rest, less
    # shard_overhead_us per piece; the cache's size and the reach are the ones of CACHE_MIB and REACH_MIB that fit best
    best = None
    for mib in CACHE_MIB:
        for reach in REACH_MIB:
            rows, ys, names = [], [], []
            for r in runs:
                f = feats[r["name"]]
                share = min(1.0, mib * 2**20 * f["world"] / f["weights"])
                for rank, laps in zip(f["ranks"], r["per_rank"]):
                    if rank["pieces"]:
                        hit = sum(b * (zipf_hit_rate(n, a, share) if share > 0 else 0.0)
                                  for b, n, a in rank["lookups"])
                        far = sum(d * max(0.0, 1 - reach * 2**20 / span) * row_lines(row)
                                  for d, span, row in rank["spans"]) if reach else 0.0
                        rows.append([rank["groups"], rank["bags"], rank["bag_cols"], rank["distinct"], far, hit,
                                     rank["bytes"] - hit])
                        ys.append(laps["emb_fwd"] + laps["emb_bwd"] - rank["pieces"] * f["shard_overhead_ms"])
                        names.append(r["name"])
            coef = _fit(rows, ys)
            err = float(np.sqrt(np.mean((np.array(rows) @ np.array(coef) / np.array(ys) - 1) ** 2)))
            if best is None or err < best[0]:
                best = (err, mib, reach, coef, rows, ys, names)
    _, mib, reach, coef, rows, ys, names = best
    g, bag, bag_col, per_row, per_far_line, cached, byte = coef
    for n, x, y in zip(names, rows, ys):
        check("compute", n, y, float(np.dot(coef, x)))

    def preset_gbs(ms_per_byte: float) -> float:   # forward + backward ms per byte -> the preset's GB/s
        return 1 / (ms_per_byte / (1 + any_f["bwd_multiplier"])) / 1e6 / any_f["hbm_efficiency"]

    out = {"device.tbe_us_per_group": g * 1e3, "device.tbe_ns_per_bag": bag * 1e6,
           "device.tbe_ns_per_bag_column": bag_col * 1e6, "device.tbe_ns_per_row": per_row * 1e6,
           "device.tbe_ns_per_far_line": per_far_line * 1e6,
           "device.table_reach_mib": reach if per_far_line > 0 else 0.0,
           "device.hbm_bandwidth_gbs": preset_gbs(byte) if byte > 0 else None,
           "device.cache_mib": mib if cached > 0 else 0.0,
           "device.cache_bandwidth_gbs": preset_gbs(cached) if cached > 0 else None}
    # data, ids exchanged in the step: per batch, sample, bag, id, the bags and ids scaled by the one of
    # SYNTHETIC_EXPONENTS that fits best (costs.scaled_items)
    def generated(f: dict, exponent: float) -> list[float]:
        return [1.0, f["batch"], scaled_items(f["bags"], exponent), scaled_items(f["ids"], exponent)]

    best = None
    for exponent in SYNTHETIC_EXPONENTS if exponent is None else (exponent,):
        rows, ys, names = [], [], []
        for r in runs:
            f = feats[r["name"]]
            if not f["prefetch_ids"]:
                rows.append(generated(f, exponent))
                ys.append(r["breakdown"]["prefetch"])
                names.append(r["name"])
        coef = _fit(rows, ys)
        err = float(np.sqrt(np.mean((np.array(rows) @ np.array(coef) / np.array(ys) - 1) ** 2)))
        if best is None or err < best[0]:
            best = (err, exponent, coef, rows, ys, names)
    _, exponent, gen, rows, ys, names = best
    for n, x, y in zip(names, rows, ys):
        check("data", n, y, float(np.dot(gen, x)))
    out |= {"host.synthetic_us_per_batch": gen[0] * 1e3, "host.synthetic_us_per_sample": gen[1] * 1e3,
            "host.synthetic_ns_per_bag": gen[2] * 1e6, "host.synthetic_ns_per_id": gen[3] * 1e6,
            "host.synthetic_exponent": exponent}
    # the id routing in the step (ids exchanged in the step: table-wise runs): the comm_input lap (the router's pass
    # over the batch, the pipelined id all-to-all's send and wait) per step and per id the rank receives; the per-step
    # part is the collective's, priced as collective_latency_us (reported beside it, not a key)
    rows, ys, names = [], [], []
    for r in runs:
        f = feats[r["name"]]
        if not f["prefetch_ids"]:
            for rank, laps in zip(f["ranks"], r["per_rank"]):
                rows.append([1.0, rank["ids"]])
                ys.append(laps["comm_input"])
                names.append(r["name"])
    routing_per_id = any_f["routing_ns_per_id"] / 1e6
    if len({x[1] for x in rows}) >= 2:
        in_step, routing_per_id = _fit(rows, ys)
        for n, x, y in zip(names, rows, ys):
            check("ids in the step", n, y, in_step + routing_per_id * x[1])
        out |= {"device.routing_ns_per_id": routing_per_id * 1e6, "(ids in the step: ms per step)": in_step}
    # the id routing in the prefetch thread (row-wise runs): the prefetch lap beyond the generation fitted above
    rows, ys, names = [], [], []
    for r in runs:
        f = feats[r["name"]]
        if f["prefetch_ids"]:
            made = float(np.dot(gen, generated(f, exponent)))
            for rank, laps in zip(f["ranks"], r["per_rank"]):
                rows.append([1.0, rank["ids"]])
                ys.append(laps["prefetch"] - made)
                names.append(r["name"])
    if len({x[1] for x in rows}) >= 2:
        step, per_id = _fit(rows, ys)
        for n, x, y in zip(names, rows, ys):
            check("routing", n, y, step + per_id * x[1])
        out |= {"device.routing_us_per_step": step * 1e3,
                "device.routing_ns_per_row_id": (per_id - routing_per_id) * 1e6}
    # dense: a fixed time per step (whatever the layers: a per-kernel term, 6 kernels per layer, fitted 0 beside
    # it over MLPs of 4-7 layers), training FLOPs, activation bytes, and where the plan syncs the dense gradients by
    # DDP its all-reduce as exposed after the backward (costs.ddp_exposed_ms over the step's buckets), at the one of
    # DDP_LATENCY_US that fits best
    best = None
    for us in DDP_LATENCY_US:
        rows, ys, names, exposed = [], [], [], []
        for r in runs:
            f = feats[r["name"]]
            held = 0.0 if passes is None else passes * f["act_bytes"] / f["stream_gbs"] / 1e6
            rows.append([1.0, f["train_flops"]] + ([f["act_bytes"]] if passes is None else []))
            ys.append(r["breakdown"]["dense"] - f["ddp"][us] - held)
            exposed.append(f["ddp"][us] + held)
            names.append(r["name"])
        coef = _fit(rows, ys)
        if passes is not None:   # the held term rides in `exposed`; its coefficient reported as if fitted
            coef = coef + [passes / any_f["stream_gbs"] / 1e6]
            rows = [x + [0.0] for x in rows]
        fitted = np.array(rows) @ np.array(coef) + np.array(exposed)
        laps = np.array(ys) + np.array(exposed)
        err = float(np.sqrt(np.mean((fitted / laps - 1) ** 2)))
        if best is None or err < best[0]:
            best = (err, us, coef, names, fitted, laps)
    _, ddp_us, (fixed, per_flop, per_act), names, fitted, laps = best
    for n, y, fy in zip(names, laps, fitted):
        check("dense", n, y, fy)
    out |= {"device.dense_fixed_us": fixed * 1e3, "dense_tflops": 1 / per_flop / 1e9,
            "planner.costs.dense_activation_passes": per_act * any_f["stream_gbs"] * 1e6, "ddp_latency_us": ddp_us}
    # a collective inside a step and the exchange's host copies per byte: the output exchange's two collectives
    # (forward outputs, backward gradients: comm_fwd + comm_bwd per rank, less their kernels as priced) fitted to its
    # all-to-alls and its reduce-scatters and all-gathers (each kind a latency of its own) + their bytes, each kind's
    # at a rate of its own (the bytes of the records the cost model prices, and the dense gradients riding in the
    # backward all-to-all where the plan folds them; a calibration run's tables are all of one kind) + the exchange's
    # wait behind DDP's first bucket where DDP syncs them + a cost per bag the outputs carry (the rank's pieces'
    # bags); runs whose all-to-all travels behind the bottom MLP (their laps hold only what it leaves exposed) are
    # left out, unless the preset's bottom MLP hides none of it
    rows, ys, names = [], [], []
    for r in runs:
        f = feats[r["name"]]
        if f["overlap"]:
            continue
        for rank, laps in zip(f["ranks"], r["per_rank"]):
            if rank["pieces"]:
                gathered = f["gather_collectives"] > 0
                moved = rank["out_bytes"]
                rows.append([f["a2a_collectives"], f["gather_collectives"],
                             (0.0 if gathered else moved) + f["riders"], moved if gathered else 0.0,
                             f["ddp_waits"], rank["bags"]])
                ys.append(laps["comm_fwd"] + laps["comm_bwd"] - f["exchange_kernels_ms"])
                names.append(r["name"])
    alpha, gather, per_byte, per_gathered, ddp_wait, per_bag = _fit(rows, ys)
    for n, x, y in zip(names, rows, ys):
        check("exchange", n, y, alpha * x[0] + gather * x[1] + per_byte * x[2] + per_gathered * x[3] + ddp_wait * x[4]
              + per_bag * x[5])
    out["collective_latency_us"] = alpha * 1e3
    out["reduce_scatter_latency_us"] = gather * 1e3
    out["ddp_exchange_wait_us"] = ddp_wait * 1e3
    out["device.exchange_ns_per_bag"] = per_bag * 1e6
    copy = per_byte - any_f["link_ms_per_byte"]
    out["device.exchange_copy_gbs"] = 1 / copy / 1e6 if copy > 0 else None
    copy = per_gathered - any_f["gather_link_ms_per_byte"]
    out["device.gather_copy_gbs"] = 1 / copy / 1e6 if copy > 0 else None
    return {"preset": {key: v if v is None else round(v, 3) for key, v in out.items()}, "measured/fitted": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=",".join(run_names()))
    ap.add_argument("--out", help="write the runs' laps (JSON) here")
    ap.add_argument("--fit", nargs="*", default=[], help="fit these saved runs' laps instead of training")
    ap.add_argument("--passes", type=float, help="hold planner.costs.dense_activation_passes at this value")
    ap.add_argument("--exponent", type=float, help="hold host.synthetic_exponent at this value")
    ap.add_argument("--quiet", type=float, help="fit only the saved runs during which other processes took at most "
                    "this share of the cores")
    a = ap.parse_args()
    if a.fit:
        runs = [x for p in a.fit for x in json.loads(Path(p).read_text())
                if a.quiet is None or x.get("others", 0.0) <= a.quiet]
        print(f"fitting {len(runs)} runs", file=sys.stderr)
    else:
        runs = measure(a.runs.split(","))
        if a.out:
            Path(a.out).write_text(json.dumps(runs))
    print(json.dumps(fit(runs, a.passes, a.exponent), indent=1))


if __name__ == "__main__":
    main()
