"""Neocfg's planner against TorchRec's EmbeddingShardingPlanner, side by side in one run.

1. Planning time on one TorchRec module (a DLRM of the model's tables on the meta device) and GPU Topology (8 per
   node), repeats interleaved, medians: TorchRec's EmbeddingShardingPlanner; the drop-in NeocfgShardingPlanner with
   each estimator ("torchrec", "neocfg"); neocfg's own planner on its ZionEX preset at that world (its own options:
   column slices down to 16 columns, row-wise across the world) and two ablations of it, without column slices and
   without row-wise (which of the two makes its plan differ from TorchRec's).
2. Every plan rated by both estimators: TorchRec's (its shard estimators, EmbeddingPerfEstimator, summed on each
   rank: the busiest rank's total is what its planner minimizes) and neocfg's (its step estimate on the preset).
3. Measured: neocfg's plan and TorchRec's plan of the Criteo Kaggle tables (rows capped) trained in neocfg's runtime
   on cpu_local with 2 and 4 ranks (mode=train's entry), repeats interleaved plan by plan, medians and ratio.
   Both planners get the same option space: TorchRec's EBC sharder plus row-wise on CPU
   (CpuRowWiseEmbeddingBagCollectionSharder); neocfg's plan is neocfg's own (model=criteo_kaggle, cpu_local).

    .venv-torchrec/bin/python bench/bench_torchrec_plans.py [--quick] [--repeats 5] [--steps 300]
        [--models criteo_kaggle,dcnv2_mlperf,prod_856] [--gpu-worlds 8,16,32,64,128] [--torchrec-timeout 300]
        [--out outputs/bench/bench_torchrec_plans.json]   (and the .png beside it; --plot-only redraws it)
        [--record]   (writes bench/RESULTS.md's "TorchRec planner" section from parts 1-2)

TorchRec's planner can take over 12 minutes on 856 tables: --torchrec-timeout bounds its search
(EmbeddingShardingPlanner's timeout_seconds: it stops proposing then and returns the best plan so far; enumerating the
options beforehand is not bounded); the JSON says whether it ran into the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cap_rows, compose_cfg, emit, record_results  # noqa: E402

import torch  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from neocfg.interop.torchrec import (CpuRowWiseEmbeddingBagCollectionSharder, NeocfgShardingPlanner,  # noqa: E402
                                     from_sharding_plan, to_sharding_plan)
from neocfg.interop.export import to_torchrec_dict  # noqa: E402
from neocfg.planner import make_plan  # noqa: E402
from neocfg.planner.costs import CostModel, dense_cost  # noqa: E402
from neocfg.planner.estimate import rate_plan  # noqa: E402
from neocfg.planner.pipeline import plan_placement  # noqa: E402
from neocfg.types import ShardingType  # noqa: E402
from neocfg.contract import train as run  # noqa: E402

EBC_PATH = "sparse_arch.embedding_bag_collection"
# The GPU topology of part 1 and 2: TorchRec's defaults for 8-GPU hosts (ZionEX-like); the world sizes by default;
# neocfg's preset of that hardware (its own planner and its estimate of every plan).
GPU_WORLDS, GPU_LOCAL, GPU_PRESET = (8, 16, 32, 64, 128), 8, "zionex_1node"
# neocfg's own planner without column slices (TorchRec's default minimum slice is 128 columns, so a 128-wide DCNv2
# table is never cut by it) / without row-wise across the world (table-row-wise stays within a node).
NO_NARROW_SLICES = ("planner.max_column_slices=1",)
NO_ROW_WISE = ("planner.sharding_types=[" + ",".join(s.value for s in ShardingType if s is not ShardingType.row_wise)
               + "]",)
PLANNERS = ("torchrec", "dropin_torchrec_estimator", "dropin_neocfg_estimator", "native", "native_no_narrow_slices",
            "native_no_row_wise")


class SparseOnly(torch.nn.Module):
    """The embedding part alone, at DLRM's path (planning needs no dense part; DLRM's dot wants one dim)."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse_arch = torch.nn.Module()
        self.sparse_arch.embedding_bag_collection = ebc


def module_of(cfg) -> torch.nn.Module:
    tables = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                 feature_names=[f"f_{t.name}"]) for t in cfg.model.tables]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if len({t.embedding_dim for t in cfg.model.tables}) > 1:
        return SparseOnly(ebc)
    d = cfg.model.tables[0].embedding_dim
    return DLRM(embedding_bag_collection=ebc, dense_in_features=cfg.model.num_dense_features,
                dense_arch_layer_sizes=[64, d], over_arch_layer_sizes=[64, 1])


def constraints_of(cfg) -> dict[str, ParameterConstraints]:
    return {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in cfg.model.tables}


def sharders():
    return [CpuRowWiseEmbeddingBagCollectionSharder()]


def torchrec_rating(module, plan_dict: dict[str, Any], topology: Topology, batch: int,
                    constraints: dict[str, ParameterConstraints]) -> dict[str, Any]:
    """TorchRec's estimate of a plan (torchrec_plan.json data): each table's option enumerated by TorchRec with the
    plan's sharding type, kernel and column width, its shards' perf summed on the plan's ranks; the rating is the
    busiest rank's total (NoopPerfModel.rate, what EmbeddingShardingPlanner minimizes), in ms."""
    forced = {}
    for name, e in plan_dict["tables"].items():
        c = dataclasses.replace(constraints[name], sharding_types=[e["sharding_type"]],
                                compute_kernels=[e["compute_kernel"]])
        if e["sharding_type"] in ("column_wise", "table_column_wise"):
            c = dataclasses.replace(c, min_partition=e["shards"][0]["sizes"][1])
        forced[name] = c
    options = EmbeddingEnumerator(topology=topology, batch_size=batch, constraints=forced).enumerate(
        module, sharders())
    per_rank = [0.0] * topology.world_size
    parts = {"fwd_compute": 0.0, "fwd_comms": 0.0, "bwd_compute": 0.0, "bwd_comms": 0.0}
    unmatched = []
    for name, e in plan_dict["tables"].items():
        sizes = None if e["shards"] is None else [s["sizes"] for s in e["shards"]]
        cands = [o for o in options if o.name == name and o.sharding_type == e["sharding_type"]
                 and o.compute_kernel == e["compute_kernel"]
                 and (sizes is None or [list(s.size) for s in o.shards] == sizes)]
        if not cands:
            unmatched.append(name)
            continue
        for shard, rank in zip(cands[0].shards, e["ranks"]):
            per_rank[rank] += shard.perf.total
    busiest = max(range(len(per_rank)), key=per_rank.__getitem__)
    by_kind: dict[str, dict[str, float]] = {}
    for name, e in plan_dict["tables"].items():
        if name in unmatched:
            continue
        opt = next(o for o in options if o.name == name and o.sharding_type == e["sharding_type"]
                   and o.compute_kernel == e["compute_kernel"])
        for shard, rank in zip(opt.shards, e["ranks"]):
            if rank == busiest:
                kind = by_kind.setdefault(e["sharding_type"], dict.fromkeys(parts, 0.0))
                for k in parts:
                    parts[k] += getattr(shard.perf, k)
                    kind[k] += getattr(shard.perf, k)
    return {"rating_ms": max(per_rank), "per_rank_ms": [round(x, 4) for x in per_rank],
            "busiest_rank_terms_ms": {k: round(v, 4) for k, v in parts.items()},
            "busiest_rank_terms_ms_by_sharding": {s: {k: round(v, 4) for k, v in d.items()}
                                                  for s, d in by_kind.items()},
            "unmatched_tables": unmatched}


def kinds(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in plan.tables:
        out[t.sharding.value] = out.get(t.sharding.value, 0) + 1
    return out


def neocfg_terms(plan) -> dict[str, float]:
    busiest = max(plan.devices, key=lambda d: d.total_ms)
    return {"step_ms": round(plan.estimate.step_ms, 4), "busiest_compute_ms": round(busiest.compute_ms, 4),
            "busiest_comm_ms": round(busiest.comm_ms, 4), "dense_ms": round(plan.estimate.dense_ms, 4)}


def native_cfg(model: str, world: int, batch: int, extra: tuple[str, ...] = ()):
    """neocfg's own config of the model on `world` ZionEX-like GPUs (GPU_LOCAL per node): its options and cost model."""
    return compose_cfg([f"model={model}", f"hardware={GPU_PRESET}", f"hardware.nodes={world // GPU_LOCAL}",
                        f"hardware.devices_per_node={GPU_LOCAL}", f"train.batch_size={batch}", *extra])


def compare_planners(model: str, repeats: int, batch: int, world: int, timeout_s: int | None) -> dict[str, Any]:
    """Parts 1 and 2 on a GPU topology of `world` devices: every planner of PLANNERS (TorchRec's, the drop-in with
    each estimator, neocfg's own planner and its two ablations), timed, and each plan rated by both estimators
    (TorchRec's rating; neocfg's cost model of the same ZionEX-like hardware)."""
    cfg = native_cfg(model, world, batch)
    module = module_of(cfg)
    topo = Topology(world_size=world, local_world_size=GPU_LOCAL, compute_device="cuda")
    cons = constraints_of(cfg)
    paths = {t.name: EBC_PATH for t in cfg.model.tables}

    def dropin(estimator: str):
        planner = NeocfgShardingPlanner(topology=topo, batch_size=batch, constraints=cons, model_name=model,
                                        estimator=estimator)
        return lambda: (planner.plan(module, sharders()), planner.last_plan.solver)

    def native(extra: tuple[str, ...]):
        def run():
            plan = plan_placement(native_cfg(model, world, batch, extra))
            return to_sharding_plan(to_torchrec_dict(plan, "cuda"), paths), plan.solver
        return run

    def torchrec():
        planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                                           timeout_seconds=timeout_s)
        return planner.plan(module, sharders()), None

    makers = {"torchrec": torchrec, "dropin_torchrec_estimator": dropin("torchrec"),
              "dropin_neocfg_estimator": dropin("neocfg"), "native": native(()),
              "native_no_narrow_slices": native(NO_NARROW_SLICES), "native_no_row_wise": native(NO_ROW_WISE)}
    times: dict[str, list[float]] = {k: [] for k in makers}
    plans: dict[str, Any] = {}
    solvers: dict[str, Any] = {}
    for _ in range(repeats):  # interleaved
        for who, make in makers.items():
            t = time.perf_counter()
            plans[who], solver = make()
            times[who].append(time.perf_counter() - t)
            if solver is not None:
                solvers[who] = {"status": solver.status, "gap": round(solver.gap, 4)}
    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {"model": model, "tables": len(cfg.model.tables), "world": world,
                              "torchrec_timeout_s": timeout_s,
                              "torchrec_hit_timeout": bool(timeout_s) and max(times["torchrec"]) > timeout_s,
                              "neocfg_solvers": solvers,
                              "planning_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                              "planning_s_median": {k: round(v, 3) for k, v in med.items()}}
    result.update(rate_all(cfg, module, plans, topo, batch, cons))
    return result


def rate_all(cfg, module, plans: dict[str, Any], topo: Topology, batch: int,
             cons: dict[str, ParameterConstraints]) -> dict[str, Any]:
    """Every plan by both estimators: TorchRec's rating (busiest rank's summed shard perf) and neocfg's step estimate
    under `cfg` (rated even where neocfg's memory model finds a device over its capacity)."""
    out: dict[str, Any] = {"neocfg_estimate": {}, "torchrec_estimate": {}, "shardings": {}, "column_slices": {}}
    for who, sp in plans.items():
        rated = rate_plan(cfg, from_sharding_plan(sp, module, sharders(), topo.world_size, topo.local_world_size,
                                                  batch, cfg.model.name), who, check_memory=False)
        out["neocfg_estimate"][who] = neocfg_terms(rated)
        out["torchrec_estimate"][who] = torchrec_rating(module, to_torchrec_dict(rated, topo.compute_device), topo,
                                                        batch, cons)
        out["shardings"][who] = kinds(rated)
        out["column_slices"][who] = sorted({len(t.shards) for t in rated.tables if t.sharding.value in
                                            ("column_wise", "table_column_wise")})
    base_n = out["neocfg_estimate"]["torchrec"]["step_ms"]
    base_t = out["torchrec_estimate"]["torchrec"]["rating_ms"]
    # above 1: the plan is worse than TorchRec's by that estimator
    out["over_torchrec_by_neocfg"] = {k: round(v["step_ms"] / base_n, 3) for k, v in out["neocfg_estimate"].items()}
    out["over_torchrec_by_torchrec"] = {k: round(v["rating_ms"] / base_t, 3)
                                        for k, v in out["torchrec_estimate"].items()}
    return out


def rate_both(ours: NeocfgShardingPlanner, module, plans: dict[str, Any], topo: Topology, batch: int,
              cons: dict[str, ParameterConstraints], cfg=None) -> dict[str, Any]:
    """Both estimators on both plans (cfg: rate with this neocfg config instead of the planner's own)."""
    out: dict[str, Any] = {"neocfg_estimate": {}, "torchrec_estimate": {}, "shardings": {},
                           "fits_neocfg_memory_model": {}}
    for who, sp in plans.items():
        # rated even where neocfg's memory model (10% HBM reserve, its buffers) finds a device over capacity: said in
        # fits_neocfg_memory_model
        if cfg is None:
            rated = ours.rate(module, sp, sharders(), check_memory=False)
        else:
            rated = rate_plan(cfg, from_sharding_plan(sp, module, sharders(), topo.world_size,
                                                      topo.local_world_size, batch, cfg.model.name), who,
                              check_memory=False)
        c = cfg if cfg is not None else ours.config(module, sharders())
        cap, dense = CostModel.from_config(c).capacity, dense_cost(c).resident_bytes   # hbm_bytes counts the dense
        out["fits_neocfg_memory_model"][who] = all(d.hbm_bytes - dense <= cap.hbm and d.host_bytes <= cap.host
                                                   for d in rated.devices)
        out["neocfg_estimate"][who] = neocfg_terms(rated)
        out["torchrec_estimate"][who] = torchrec_rating(module, to_torchrec_dict(rated, topo.compute_device), topo,
                                                        batch, cons)
        out["shardings"][who] = kinds(rated)
    n, t = out["neocfg_estimate"], out["torchrec_estimate"]
    out["neocfg_says_torchrec_over_neocfg"] = round(n["torchrec"]["step_ms"] / n["neocfg"]["step_ms"], 3)
    out["torchrec_says_torchrec_over_neocfg"] = round(t["torchrec"]["rating_ms"] / t["neocfg"]["rating_ms"], 3)
    return out


def print_terms(r: dict[str, Any]) -> None:
    """Each plan's planning time, shardings and the busiest device's terms by each estimator (ms)."""
    for who in PLANNERS:
        n, t = r["neocfg_estimate"][who], r["torchrec_estimate"][who]
        tt = t["busiest_rank_terms_ms"]
        print(f"  {who:26s} {r['planning_s_median'][who]:7.2f} s  vs TorchRec's plan: x{r['over_torchrec_by_torchrec'][who]}"
              f" by TorchRec's estimator ({t['rating_ms']:.3f} ms: busiest fwd/bwd compute {tt['fwd_compute']:.3f}/"
              f"{tt['bwd_compute']:.3f}, comms {tt['fwd_comms']:.3f}/{tt['bwd_comms']:.3f}), x"
              f"{r['over_torchrec_by_neocfg'][who]} by neocfg's (step {n['step_ms']:.3f} ms); {r['shardings'][who]}"
              f"{', slices ' + str(r['column_slices'][who]) if r['column_slices'][who] else ''}"
              f"{', unmatched ' + str(len(t['unmatched_tables'])) if t['unmatched_tables'] else ''}", flush=True)


def results_section(planning: list[dict[str, Any]]) -> str:
    """bench/RESULTS.md's '## TorchRec planner' body: planning time and plan quality by both estimators."""
    names = {"torchrec": "TorchRec", "dropin_torchrec_estimator": "drop-in, TorchRec's estimator",
             "dropin_neocfg_estimator": "drop-in, neocfg's estimator", "native": "neocfg's own planner",
             "native_no_narrow_slices": "... without column slices", "native_no_row_wise": "... without row-wise"}
    lines = ["Each plan against TorchRec's `EmbeddingShardingPlanner`'s plan of the same tables, Topology (8 GPUs per "
             "node, batch 512 per GPU, TorchRec's EBC sharder + row-wise), rated by TorchRec's estimator (the busiest "
             "rank's summed shard perf, what its planner minimizes) and by neocfg's (its step estimate on the "
             f"`{GPU_PRESET}` preset at that world). Above x1 the plan is worse than TorchRec's by that estimator. "
             "\"drop-in\" is `NeocfgShardingPlanner` (TorchRec's options); \"neocfg's own planner\" is `neocfg "
             "mode=plan` on the preset (its own options: column slices down to 16 columns, row-wise across the "
             "world), and its two ablations remove one of those. Planning time: median of the repeats, in seconds.",
             "", "In short (each plan's step over TorchRec's plan's, by TorchRec's estimator / by neocfg's):", "",
             "| model | GPUs | planning s: TorchRec / drop-in | drop-in, TorchRec's estimator | drop-in, neocfg's "
             "estimator | neocfg's own planner |", "|---|---:|---|---|---|---|"]
    for r in planning:
        by = {who: f"x{r['over_torchrec_by_torchrec'][who]} / x{r['over_torchrec_by_neocfg'][who]}" for who in PLANNERS}
        s = r["planning_s_median"]
        lines.append(f"| {r['model']} | {r['world']} | {s['torchrec']:.2f} / {s['dropin_torchrec_estimator']:.2f} |"
                     f" {by['dropin_torchrec_estimator']} | {by['dropin_neocfg_estimator']} | {by['native']} |")
    lines.append("")
    for r in planning:
        lines += [f"**{r['model']} ({r['tables']} tables), {r['world']} GPUs**"
                  f"{' (TorchRec ran into its timeout)' if r['torchrec_hit_timeout'] else ''}", "",
                  "| planner | planning s | by TorchRec's estimator | by neocfg's | shardings |", "|---|---|---|---|---|"]
        for who in PLANNERS:
            t, n = r["torchrec_estimate"][who], r["neocfg_estimate"][who]
            kinds_ = ", ".join(f"{k} {v}" for k, v in sorted(r["shardings"][who].items()))
            slices = f" (column slices {r['column_slices'][who]})" if r["column_slices"][who] else ""
            lines.append(f"| {names[who]} | {r['planning_s_median'][who]:.2f} | x{r['over_torchrec_by_torchrec'][who]}"
                         f" ({t['rating_ms']:.3f} ms) | x{r['over_torchrec_by_neocfg'][who]} ({n['step_ms']:.3f} ms) |"
                         f" {kinds_}{slices} |")
        lines.append("")
    return "\n".join(lines)


def measure(world: int, rows_cap: int, batch: int, steps: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Part 3: both plans of capped Criteo Kaggle in neocfg's runtime on `world` local CPU ranks."""
    base = ["model=criteo_kaggle", *cap_rows("criteo_kaggle", rows_cap), "hardware=cpu_local",
            f"hardware.devices_per_node={world}", f"train.batch_size={batch}", f"train.steps={steps}",
            "train.eval_batches=0", f"train.log_every={steps}"]
    cfg = compose_cfg(["mode=train", *base])
    module = module_of(cfg)
    topo = Topology(world_size=world, local_world_size=world, compute_device="cpu")
    cons = constraints_of(cfg)
    t = time.perf_counter()
    neocfg_plan = make_plan(cfg)
    neocfg_s = time.perf_counter() - t
    t = time.perf_counter()
    torchrec_sp = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons,
                                           debug=False).plan(module, sharders())
    torchrec_s = time.perf_counter() - t
    torchrec_plan = rate_plan(cfg, from_sharding_plan(torchrec_sp, module, sharders(), world, world, batch,
                                                      cfg.model.name), "torchrec")
    files = {}
    for who, plan in (("neocfg", neocfg_plan), ("torchrec", torchrec_plan)):
        files[who] = tmp / f"plan_{who}_{world}.json"
        plan.save(files[who])
    sps = {"neocfg": to_sharding_plan(to_torchrec_dict(neocfg_plan, "cpu"),
                                      {t.name: EBC_PATH for t in cfg.model.tables}), "torchrec": torchrec_sp}
    ours = NeocfgShardingPlanner(topology=topo, batch_size=batch, constraints=cons, hardware="cpu_local")
    rated = rate_both(ours, module, sps, topo, batch, cons, cfg=cfg)
    measured: dict[str, list[float]] = {"neocfg": [], "torchrec": []}
    for i in range(repeats):  # interleaved: neocfg, torchrec, neocfg, ...
        for who in ("neocfg", "torchrec") if i % 2 == 0 else ("torchrec", "neocfg"):
            run_cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(files[who])))
            with contextlib.redirect_stdout(io.StringIO()):  # run() prints its report; the JSON keeps the numbers
                m = run(run_cfg, tmp / f"run_{who}_{world}_{i}")
            measured[who].append(m.measured_step_ms)
            print(f"  world {world} {who} repeat {i}: {m.measured_step_ms:.2f} ms/step", file=sys.stderr,
                  flush=True)
    med = {k: statistics.median(v) for k, v in measured.items()}
    # Each repeat runs both plans back to back: the ratio within a pair is less exposed to the machine's load drifting
    # between repeats than the ratio of the medians.
    pairs = [t / n for n, t in zip(measured["neocfg"], measured["torchrec"])]
    return {"world": world, "rows_cap": rows_cap, "batch_per_rank": batch, "steps": steps, "repeats": repeats,
            "planning_s": {"neocfg": round(neocfg_s, 3), "torchrec": round(torchrec_s, 3)},
            "measured_step_ms": {k: [round(x, 2) for x in v] for k, v in measured.items()},
            "measured_step_ms_median": {k: round(v, 2) for k, v in med.items()},
            "measured_torchrec_over_neocfg": round(med["torchrec"] / med["neocfg"], 3),
            "paired_torchrec_over_neocfg": [round(x, 3) for x in pairs],
            "paired_torchrec_over_neocfg_median": round(statistics.median(pairs), 3), **rated}


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: planning time per model; right: measured step per world size (median and every repeat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"neocfg": "#4c72b0", "torchrec": "#dd8452"}
    for who in PLANNERS:   # plan quality by TorchRec's estimator against the world size
        rs = result["planning"]
        ax_p.plot([r["world"] for r in rs], [r["over_torchrec_by_torchrec"][who] for r in rs], "o-", label=who)
    ax_p.set_xscale("log", base=2)
    ax_p.set_xlabel("GPUs")
    ax_p.set_ylabel("plan / TorchRec's plan, by TorchRec's estimator")
    ax_p.legend(fontsize=7)
    for i, r in enumerate(result["measured"]):
        for j, who in enumerate(("neocfg", "torchrec")):
            x = i + 0.4 * j - 0.2
            ax_m.bar(x, r["measured_step_ms_median"][who], 0.4, color=colors[who],
                     label=f"{who} plan" if i == 0 else None)
            ax_m.plot([x] * len(r["measured_step_ms"][who]), r["measured_step_ms"][who], "k.", ms=4)
    ax_m.set_xticks(range(len(result["measured"])),
                    [f"cpu_local x{r['world']}" for r in result["measured"]])
    ax_m.set_ylabel("measured ms per step in neocfg's runtime")
    ax_m.set_title("criteo_kaggle (rows capped): median, dots = repeats", fontsize=9)
    ax_m.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 planning repeat, 2 measured repeats of 60 steps")
    ap.add_argument("--models", default="criteo_kaggle,dcnv2_mlperf")
    ap.add_argument("--plan-repeats", type=int, default=3)
    ap.add_argument("--gpu-worlds", default=",".join(map(str, GPU_WORLDS)), help="GPU world sizes of parts 1-2")
    ap.add_argument("--torchrec-timeout", type=int, default=None,
                    help="seconds TorchRec's planner may search (timeout_seconds; default: unbounded)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-planning", action="store_true")
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--out", default="outputs/bench/bench_torchrec_plans.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out's JSON")
    ap.add_argument("--record", action="store_true", help="write bench/RESULTS.md's '## TorchRec planner'")
    ap.add_argument("--append", action="store_true",
                    help="keep --out's planning results and add these worlds (one short run per world)")
    a = ap.parse_args()
    png = Path(a.out).with_suffix(".png")
    if a.plot_only:
        import json

        plot(json.loads(Path(a.out).read_text()), png)
        return
    if a.quick:
        a.plan_repeats, a.repeats, a.steps = 1, 2, 60
    logging.disable(logging.WARNING)  # TorchRec's planner logs its tables and warnings at length
    warnings.filterwarnings("ignore")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"bench": "bench_torchrec_plans", "planning": [], "measured": []}
    if a.append and Path(a.out).exists():
        import json

        result["planning"] = json.loads(Path(a.out).read_text())["planning"]
    if not a.skip_planning:
        for model, world in ((m, int(w)) for m in a.models.split(",") for w in a.gpu_worlds.split(",")):
            result["planning"] = [r for r in result["planning"] if (r["model"], r["world"]) != (model, world)]
            r = compare_planners(model, a.plan_repeats, 512, world, a.torchrec_timeout)
            result["planning"].append(r)
            result["planning"].sort(key=lambda x: (x["model"], x["world"]))
            bounded = " (TorchRec ran into --torchrec-timeout)" if r["torchrec_hit_timeout"] else ""
            print(f"{model} on {world} GPUs{bounded}:", flush=True)
            print_terms(r)
            emit(result, a.out)   # each world as it comes
    if not a.skip_measure:
        with tempfile.TemporaryDirectory() as tmp:
            for world in (int(x) for x in a.worlds.split(",")):
                r = measure(world, a.rows_cap, a.batch, a.steps, a.repeats, Path(tmp))
                result["measured"].append(r)
                med = r["measured_step_ms_median"]
                print(f"criteo_kaggle (rows <= {a.rows_cap:,}) on cpu_local x{world}: measured neocfg plan "
                      f"{med['neocfg']:.2f} ms, TorchRec plan {med['torchrec']:.2f} ms (median of {a.repeats}) -> "
                      f"TorchRec/neocfg x{r['measured_torchrec_over_neocfg']} (median of paired ratios "
                      f"x{r['paired_torchrec_over_neocfg_median']}); estimates TorchRec/neocfg: neocfg "
                      f"x{r['neocfg_says_torchrec_over_neocfg']}, TorchRec x{r['torchrec_says_torchrec_over_neocfg']}",
                      flush=True)
    emit(result, a.out)
    plot(result, png)
    print(f"plot {png}", file=sys.stderr)
    if a.record and result["planning"]:
        record_results("TorchRec planner", results_section(result["planning"]))


if __name__ == "__main__":
    main()
