"""The estimate term by term: each term of the plan's step time next to the measurement it models.

Three kinds of model, each planned table-wise only and row-wise only, then trained on cpu_local's 2 gloo ranks by
the real CLI (`python -m neocfg mode=train ...`, one process tree per run, `--runs` runs each); the terms come from
the run's metrics.json (neocfg.run_metrics.RunMetrics.predicted_vs_measured_ms):

  small    8 tables of dim 16, 1k-200k rows, pooling 1-4, uniform ids (zipf_alpha 0)
  criteo   criteo_kaggle, tables capped at 1M rows
  unseen_dim32, unseen_dim8   shapes the calibration did not see (dims 32 and 8, skewed ids, 40 and 400 tables)
  unseen_dim64, unseen_mixed  (not in the default list) 12 tables of dim 64 with 20k-1M rows and Zipf 1.2 ids;
           99 tables of dims 8, 16 and 32 in turn, uniform ids
  prod856  prod_856's 856 tables, pooling factors x 2.6 (~12,600 ids per sample), dim 16, capped at 20k rows (as
           bench/bench_856.py --pooling-scale 2.6), a few steps

A term passes when it is below `--floor` (5 %) of the measured step or its prediction is within `--tolerance`
(25 %) of the measurement. Prints one table per run and, with --record, writes bench/RESULTS.md's
"Estimate term by term" section.

    .venv/bin/python bench/estimate_terms.py [--kinds small,criteo,prod856] [--shardings table_wise,row_wise]
        [--runs 2] [--record] [--set hardware.collective_latency_us=1000 ...] [--out terms.json]
    .venv/bin/python bench/estimate_terms.py --merge small.json criteo.json ... --record   (runs made one kind at a
        time with --out, as the CPU lock allows, recorded as one section)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, compose_cfg, emit, record_results  # noqa: E402

from neocfg.run_metrics import METRICS_FILE, RunMetrics  # noqa: E402

SECTION = "Estimate term by term"
# The small model's tables: (rows, pooling); dim 16, uniform ids.
SMALL_TABLES = [(1_000, 1), (5_000, 2), (20_000, 1), (50_000, 3), (100_000, 1), (200_000, 4), (2_000, 2),
                (10_000, 1)]
CRITEO_ROWS_CAP = 1_000_000
PROD_ROWS_CAP = 20_000
PROD_POOLING_SCALE = 2.6   # prod_856's ~4,900 ids per sample -> ~12,600
DIM = 16
# A run during which other processes (and the hypervisor's steal) took more than this share of the machine's cores is
# disturbed: the memory-bound terms of the large models then run 1.5-2x slower (seen on this shared 2-core VM with
# helpers working beside the CPU lock); it is repeated, up to --retries times, and the share is recorded either way.
DISTURBED_SHARE = 0.15


# The machine's speed beside each run (two quiet runs of the small model once differed by a third in every lap): a
# fixed workload timed just before the run, on one thread: PROBE_MATMULS products of PROBE_SIZE-square fp32 matrices
# (compute), and PROBE_HANDOFFS round trips of a byte through a pipe to another process (the wake-up that each gloo
# handoff of a small step waits for), and a gather of PROBE_GATHER random 64-byte rows of a table of PROBE_TABLE_ROWS
# (128 MiB: memory, not the processor caches, as a TBE's lookups of large tables; the matmuls do not see the memory
# bandwidth that other tenants of the host take, and the same model's lookups read 1.72 and 2.2 ms half an hour
# apart under the same matmul time). Recorded beside the run, not used by the estimate.
PROBE_SIZE, PROBE_MATMULS, PROBE_HANDOFFS = 256, 200, 400
PROBE_TABLE_ROWS, PROBE_GATHER = 1 << 21, 1 << 20


def _echo(conn) -> None:
    while conn.recv_bytes() != b"":
        conn.send_bytes(b"x")


def probe() -> dict:
    """{"matmul_ms": the products' time, "handoff_us": the median round trip, "gather_ms": the best of 3 gathers},
    measured now."""
    import multiprocessing as mp

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE)
    a @ a
    t = time.perf_counter()
    for _ in range(PROBE_MATMULS):
        a @ a
    matmul_ms = (time.perf_counter() - t) * 1e3
    table = torch.ones(PROBE_TABLE_ROWS, 16)
    rows = torch.randint(PROBE_TABLE_ROWS, (PROBE_GATHER,))
    gathers = []
    for _ in range(4):   # (the first pages in the output)
        t = time.perf_counter()
        table.index_select(0, rows)
        gathers.append(time.perf_counter() - t)
    del table
    torch.set_num_threads(threads)
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_echo, args=(theirs,), daemon=True)
    child.start()
    trips = []
    for _ in range(PROBE_HANDOFFS):
        t = time.perf_counter()
        ours.send_bytes(b"x")
        ours.recv_bytes()
        trips.append(time.perf_counter() - t)
    ours.send_bytes(b"")
    child.join()
    return {"matmul_ms": matmul_ms, "handoff_us": sorted(trips)[len(trips) // 2] * 1e6,
            "gather_ms": min(gathers[1:]) * 1e3}


@dataclass(frozen=True)
class Kind:
    name: str
    model: dict            # the model preset written for the run
    steps: int
    extra: tuple[str, ...] = ()


def _small() -> dict:
    return {"name": "terms_small", "num_dense_features": 13, "bottom_mlp": [64, 32, DIM], "top_mlp": [64, 32, 1],
            "interaction": "dot",
            "tables": [{"name": f"t{i}", "num_embeddings": rows, "embedding_dim": DIM, "pooling_factor": pool,
                        "zipf_alpha": 0.0} for i, (rows, pool) in enumerate(SMALL_TABLES)]}


def _from_preset(preset: str, name: str, cap: int, dim: int | None = None, pooling_scale: float = 1.0,
                 **changes) -> dict:
    model = yaml.safe_load((REPO / "conf" / "model" / f"{preset}.yaml").read_text())
    model["name"] = name
    for t in model["tables"]:
        t["num_embeddings"] = min(t["num_embeddings"], cap)
        t["pooling_factor"] = t["pooling_factor"] * pooling_scale
        if dim is not None:
            t["embedding_dim"] = dim
    model.update(changes)
    return model


def _unseen(name: str, tables: int, dim: int, rows: list[int], pooling: list[float], alpha: float, bottom: list[int],
            top: list[int], **changes) -> dict:
    """A model of a shape the calibration (bench/calibrate_step.py) did not see: rows and pooling cycle over the lists."""
    return {"name": name, "num_dense_features": 13, "bottom_mlp": bottom, "top_mlp": top,
            "tables": [{"name": f"u{i}", "num_embeddings": rows[i % len(rows)], "embedding_dim": dim,
                        "pooling_factor": pooling[i % len(pooling)], "zipf_alpha": alpha} for i in range(tables)],
            **changes}


def _mixed_dims(model: dict, dims: tuple[int, ...]) -> dict:
    """The model with its tables' dims cycling over `dims`."""
    return {**model, "tables": [{**t, "embedding_dim": dims[i % len(dims)]} for i, t in enumerate(model["tables"])]}


def kinds() -> dict[str, Kind]:
    mixed = _unseen("terms_unseen_mixed", 99, 16, [2_000, 30_000, 300_000], [1, 10, 3, 6], 0.0, [64, 32], [128, 1],
                    interaction="dcn", dcn_low_rank_dim=16, dcn_num_layers=1)
    criteo = Kind("criteo", _from_preset("criteo_kaggle", "terms_criteo", CRITEO_ROWS_CAP), steps=200)
    # shapes held out of the choice of the compute term's form and of the calibration: dim 24 over 3k-1.5M rows with
    # mildly skewed ids; uniform ids over wide rows (dim 48); 200 small skewed tables
    held_out = {
        "unseen_dim24": Kind("unseen_dim24", _unseen("terms_unseen_dim24", 30, 24, [50_000, 400_000, 3_000, 1_500_000],
                                                     [4, 1, 12, 2], 0.7, [128, 24], [128, 64, 1], interaction="dot"),
                             steps=80),
        "unseen_wide48u": Kind("unseen_wide48u", _unseen("terms_unseen_wide48u", 24, 48, [200_000, 800_000], [3, 6],
                                                         0.0, [64, 48], [128, 1], interaction="dcn",
                                                         dcn_low_rank_dim=16, dcn_num_layers=1), steps=60),
        "unseen_tiny200": Kind("unseen_tiny200", _unseen("terms_unseen_tiny200", 200, 16, [500, 5_000, 20_000],
                                                         [1, 2, 4], 1.0, [64, 16], [64, 1], interaction="dcn",
                                                         dcn_low_rank_dim=8, dcn_num_layers=1), steps=40,
                               extra=("planner.time_limit_s=20",)),
    }
    return {
        "small": Kind("small", _small(), steps=300),
        "criteo": criteo,
        # as bench/bench_856.py: one low-rank DCN layer of rank 16, small MLPs, trainable
        "prod856": Kind("prod856", _from_preset("prod_856", "terms_prod856", PROD_ROWS_CAP, DIM, PROD_POOLING_SCALE, interaction="dcn",
                                                dcn_low_rank_dim=16, dcn_num_layers=1, bottom_mlp=[64, DIM],
                                                top_mlp=[64, 1], planning_only=False), steps=30,
                        extra=("planner.time_limit_s=20",)),
        # not seen by the calibration: dim 32, Zipf-skewed ids, two DCN layers of rank 32
        "unseen_dim32": Kind("unseen_dim32", _unseen("terms_unseen_dim32", 40, 32, [5_000, 50_000, 500_000],
                                                     [2, 5, 20, 1], 1.05, [128, 32], [256, 64, 1], interaction="dcn",
                                                     dcn_low_rank_dim=32, dcn_num_layers=2), steps=60),
        # not seen: 400 tables of dim 8, pooling 1-8, one DCN layer of rank 8
        "unseen_dim8": Kind("unseen_dim8", _unseen("terms_unseen_dim8", 400, 8, [1_000, 10_000, 50_000],
                                                   [1, 3, 8, 2], 0.0, [32, 8], [64, 1], interaction="dcn",
                                                   dcn_low_rank_dim=8, dcn_num_layers=1), steps=30,
                            extra=("planner.time_limit_s=20",)),
        # not seen: wide rows of large tables, few and skewed ids, a dot interaction over dim 64
        "unseen_dim64": Kind("unseen_dim64", _unseen("terms_unseen_dim64", 12, 64, [100_000, 1_000_000, 20_000],
                                                     [1, 2, 5], 1.2, [256, 64], [256, 128, 1], interaction="dot"),
                             steps=100),
        # not seen: tables of three dims side by side (8, 16, 32 in turn), uniform ids, one DCN layer of rank 16
        "unseen_mixed": Kind("unseen_mixed", _mixed_dims(mixed, (8, 16, 32)), steps=40,
                             extra=("planner.time_limit_s=20",)),
        **held_out,
        # the same three and criteo at twice the batch (512 samples per rank)
        **{f"{name}_b512": Kind(f"{name}_b512", k.model, steps=k.steps, extra=(*k.extra, "train.batch_size=512"))
           for name, k in (*held_out.items(), ("criteo", criteo))},
    }


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds the machine spent busy and stolen (/proc/stat), this process's finished children's, and the wall."""

    busy: float
    steal: float
    ours: float
    wall: float

    @staticmethod
    def now() -> "CpuClock":
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        hz = os.sysconf("SC_CLK_TCK")
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return CpuClock((user + nice + system + irq + softirq) / hz, steal / hz, ru.ru_utime + ru.ru_stime,
                        time.monotonic())

    def others_since(self, start: "CpuClock") -> float:
        """The share of the machine's cores that other processes used, or the hypervisor stole, since `start`."""
        others = (self.busy - start.busy) - (self.ours - start.ours) + (self.steal - start.steal)
        return max(others, 0.0) / ((self.wall - start.wall) * (os.cpu_count() or 1))


def train(kind: Kind, sharding: str, conf_dir: Path, out_dir: Path, extra: list[str]) -> RunMetrics:
    """One whole run by the CLI, in its own processes."""
    args = [sys.executable, "-m", "neocfg", "--config-dir", str(conf_dir), "mode=train", f"model={kind.model['name']}",
            "hardware=cpu_local", f"planner.sharding_types=[{sharding}]", f"train.steps={kind.steps}",
            "train.eval_batches=0", f"train.log_every={kind.steps}", "train.divergence_factor=0",
            f"hydra.run.dir={out_dir}", *kind.extra, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind.name} {sharding}: neocfg failed ({r.returncode}): {r.stderr.strip()[-600:]}")
    return RunMetrics.load(out_dir / METRICS_FILE)


@dataclass(frozen=True)
class Measured:
    metrics: RunMetrics
    run_dir: Path
    others: float      # the share of the cores other processes took during the kept run
    repeated: int      # disturbed runs repeated before it
    probe: dict        # the machine's speed just before it (probe())


def train_undisturbed(kind: Kind, sharding: str, conf_dir: Path, out_dir: Path, extra: list[str],
                      retries: int) -> Measured:
    """train(), repeated (up to `retries` times) while other processes took more than DISTURBED_SHARE of the cores;
    the last run is kept either way, with its share."""
    for attempt in range(retries + 1):
        run_dir = out_dir.with_name(f"{out_dir.name}_{attempt}")
        speed = probe()
        start = CpuClock.now()
        m = train(kind, sharding, conf_dir, run_dir, extra)
        others = CpuClock.now().others_since(start)
        if others <= DISTURBED_SHARE:
            break
        print(f"{kind.name} {sharding}: disturbed (other processes took {100 * others:.0f} % of the cores)"
              + (", repeated" if attempt < retries else ""), file=sys.stderr, flush=True)
    return Measured(m, run_dir, others, attempt, speed)


def verdict(predicted: float, measured: float, step: float, floor: float, tolerance: float) -> str:
    if measured < floor * step and predicted < floor * step:
        return "small"
    if measured <= 0:
        return "MISS"
    return "ok" if abs(predicted - measured) <= tolerance * measured else "MISS"


def rows_of(m: RunMetrics, floor: float, tolerance: float) -> list[dict]:
    step = m.measured_step_ms
    out = [{"term": name, "predicted_ms": t.predicted, "measured_ms": t.measured,
            "ratio": t.predicted / t.measured if t.measured > 0 else None, "share": t.measured / step,
            "verdict": verdict(t.predicted, t.measured, step, floor, tolerance)}
           for name, t in m.predicted_vs_measured_ms.items()]
    terms = [n for n in m.predicted_vs_measured_ms if not n.startswith("dp_")]   # dp_*: parts of the others
    out.append({"term": "sum of terms", "predicted_ms": sum(m.predicted_vs_measured_ms[n].predicted for n in terms),
                "measured_ms": sum(m.predicted_vs_measured_ms[n].measured for n in terms), "ratio": None,
                "share": None, "verdict": ""})
    out.append({"term": "step", "predicted_ms": m.predicted_step_ms, "measured_ms": step,
                "ratio": m.predicted_step_ms / step, "share": 1.0,
                "verdict": verdict(m.predicted_step_ms, step, step, floor, tolerance)})
    return out


def laps(m: RunMetrics) -> str:
    b = m.breakdown_ms
    return ", ".join(f"{k} {b[k]:.2f}" for k in ("data_wait", "comm_input", "emb_fwd", "comm_fwd", "dense",
                                                  "comm_bwd", "emb_bwd", "dp_update", "comm_dp", "prefetch", "total")
                   if k in b)


SUMMARY_TERMS = ("embedding_compute", "embedding_comm", "dense", "data", "step")


def worst(rows: list[dict]) -> str:
    """One summary cell: the run farthest from its measurement (ratio or its inverse) among the runs where the term
    is at least the floor of the step; "small" when it is under the floor in every run."""
    counted = [r for r in rows if r["verdict"] != "small" and r["ratio"] is not None]
    if not counted:
        return "small"
    far = max(counted, key=lambda r: max(r["ratio"], 1 / r["ratio"]) if r["ratio"] > 0 else float("inf"))
    return f"{far['ratio']:.2f}" + ("" if far["verdict"] == "ok" else " MISS")


def summary(results: list[dict]) -> str:
    """One row per kind, its shardings side by side in each cell (table_wise / row_wise): each term's worst run (see
    `worst`) and whether every counted term of every run is within the tolerance (else the terms outside, and under
    which sharding where the kind ran several)."""
    lines = ["| kind | sharding | runs | " + " | ".join(SUMMARY_TERMS) + " | verdict |",
             "|---|---|---|" + "---|" * (len(SUMMARY_TERMS) + 1)]
    for kind in dict.fromkeys(r["kind"] for r in results):
        shardings = list(dict.fromkeys(r["sharding"] for r in results if r["kind"] == kind))
        runs = {s: [r for r in results if (r["kind"], r["sharding"]) == (kind, s)] for s in shardings}
        cells = [" / ".join(worst([row for r in runs[s] for row in r["terms"] if row["term"] == term])
                            for s in shardings) for term in SUMMARY_TERMS]
        misses = [t + (f" ({s})" if len(shardings) > 1 else "") for t in SUMMARY_TERMS for s in shardings
                  if t != "step" and any(row["term"] == t and row["verdict"] == "MISS"
                                         for r in runs[s] for row in r["terms"])]
        verdict = "every term within" if not misses else "outside: " + ", ".join(misses)
        lines.append(f"| {kind} | {' / '.join(shardings)} | {' / '.join(str(len(runs[s])) for s in shardings)} | "
                     + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def markdown(results: list[dict]) -> str:
    lines = ["Each term's worst run per kind and sharding (a kind's shardings side by side, as the sharding column "
             "lists them): predicted / measured, the run farthest from 1 among those where the term is at least the "
             "floor of the step (small: under it in every run; MISS: outside the tolerance):", "", summary(results),
             "",
             f"Each run's heading gives the share of the machine's cores other processes took while it ran (a run over "
             f"{100 * DISTURBED_SHARE:.0f} % is repeated, up to --retries times, and says so) and the machine's speed "
             f"just before it (probe: {PROBE_MATMULS} products of {PROBE_SIZE}-square matrices on one thread, the "
             f"median round trip of a byte to another process, and, where recorded, the best of 3 gathers of "
             f"{PROBE_GATHER:,} random 64-byte rows from a 128 MiB table).", "",
             "Predicted / measured ms per step (mean over the 2 ranks; the embedding terms the busiest rank's), the "
             "ratio, the measured share of the step, and the verdict (ok: within the tolerance; small: under the "
             "floor in both):", ""]
    for r in results:
        beside = (f"; other processes {100 * r['others']:.0f} % of the cores"
                  + (f", after {r['repeated']} disturbed" if r.get("repeated") else "") if "others" in r else "")
        if "probe" in r:
            beside += (f"; machine probe: matmul {r['probe']['matmul_ms']:.0f} ms, handoff "
                       f"{r['probe']['handoff_us']:.0f} us"
                       + (f", gather {r['probe']['gather_ms']:.0f} ms" if "gather_ms" in r["probe"] else ""))
        lines += [f"**{r['kind']}, {r['sharding']}, run {r['run']}** ({r['steps']} steps{beside}; laps: {r['laps']})",
                  "",
                  "| term | predicted | measured | ratio | share | verdict |", "|---|---|---|---|---|---|"]
        for row in r["terms"]:
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
            share = "" if row["share"] is None else f"{100 * row['share']:.0f} %"
            lines.append(f"| {row['term']} | {row['predicted_ms']:.2f} | {row['measured_ms']:.2f} | {ratio} | {share}"
                         f" | {row['verdict']} |")
        lines.append("")
    misses = [f"{r['kind']}/{r['sharding']}/run {r['run']}: {row['term']}" for r in results for row in r["terms"]
              if row["verdict"] == "MISS"]
    lines.append(f"Terms outside the tolerance: {len(misses)}" + (f" ({'; '.join(misses)})" if misses else "") + ".")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="small,criteo,prod856")
    ap.add_argument("--shardings", default="table_wise,row_wise")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--floor", type=float, default=0.05)
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--record", action="store_true", help="write bench/RESULTS.md's section")
    ap.add_argument("--retries", type=int, default=2, help="repeat a disturbed run (DISTURBED_SHARE) up to this often")
    ap.add_argument("--out")
    ap.add_argument("--merge", nargs="*", default=[], help="record the results of these --out files (runs made one "
                    "kind at a time) instead of training")
    a = ap.parse_args()
    if a.merge:
        parts = [json.loads(Path(p).read_text())["results"] for p in a.merge]
        seen: dict[tuple[str, str], int] = {}
        for r in (r for part in parts for r in part):   # runs of separate invocations numbered in file order
            seen[r["kind"], r["sharding"]] = r["run"] = seen.get((r["kind"], r["sharding"]), 0) + 1
        results = sorted((r for part in parts for r in part), key=lambda r: (r["run"], list(kinds()).index(r["kind"])))
        groups = "; ".join(f"`--kinds {','.join(dict.fromkeys(r['kind'] for r in part))} --shardings "
                           f"{','.join(dict.fromkeys(r['sharding'] for r in part))} --runs "
                           f"{len({r['run'] for r in part})}`" for part in parts)
        text = (f"Runs made one group of kinds at a time under the CPU lock ({groups}), recorded together by "
                f"`--merge`.\n\n" + markdown(results))
        print(text)
        if a.record:
            record_results(SECTION, text)
        return
    chosen = [kinds()[k] for k in a.kinds.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "conf"
        (conf / "model").mkdir(parents=True)
        for kind in chosen:
            (conf / "model" / f"{kind.model['name']}.yaml").write_text(yaml.safe_dump(kind.model, sort_keys=False))
        compose_cfg(["model=dlrm_tiny"])   # the schema registered in this process too (fails early on a typo)
        for run in range(1, a.runs + 1):
            for kind in chosen:
                for sharding in a.shardings.split(","):
                    got = train_undisturbed(kind, sharding, conf, Path(tmp) / f"{kind.name}_{sharding}_{run}", a.set,
                                            a.retries)
                    m, run_dir = got.metrics, got.run_dir
                    rows = rows_of(m, a.floor, a.tolerance)
                    # the plan and each rank's laps too: the run can be re-priced under other constants
                    results.append({"kind": kind.name, "sharding": sharding, "run": run, "steps": kind.steps,
                                    "others": got.others, "repeated": got.repeated, "probe": got.probe,
                                    "laps": laps(m), "terms": rows, "per_rank": m.breakdown_ms_per_rank,
                                    "measured_step_ms": m.measured_step_ms,
                                    "plan": json.loads((run_dir / "plan.json").read_text())})
                    print(f"{kind.name} {sharding} run {run}: " + "; ".join(
                        f"{row['term']} {row['predicted_ms']:.2f}/{row['measured_ms']:.2f}"
                        + (f" ({row['ratio']:.2f}) {row['verdict']}" if row["ratio"] is not None else "")
                        for row in rows) + f"\n  laps: {laps(m)}", file=sys.stderr, flush=True)
    emit({"bench": "estimate_terms", "overrides": a.set, "floor": a.floor, "tolerance": a.tolerance,
          "results": results}, a.out)
    if a.record:
        record_results(SECTION, markdown(results))


if __name__ == "__main__":
    main()
