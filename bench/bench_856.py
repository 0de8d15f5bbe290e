"""Samples/s and the step breakdown of a prod_856-shaped model trained on cpu_local.

The model: prod_856's 856 tables and pooling factors, every table dim 16 and capped at 20,000 rows (so that it fits
a CPU), `interaction: dcn` (one low-rank layer of rank 16), bottom MLP [64, 16], top MLP [64, 1]. Two gloo ranks,
batch 256 per rank, through mode=train's own entry, once per sharding type, on the default (learnable, generated in
the prefetch thread) synthetic stream. Prints samples/s and data_wait + comm_input as a share of the step (the target
is <= 10% for both). --pooling-scale 2.6 gives about 12,600 ids per sample.

--paired-against REV: the same runs of this checkout and of git revision REV (checked out in a temporary worktree),
each run its own process importing neocfg (and composing conf/) from its tree, interleaved (this, REV, REV, this, ...)
per sharding type; the best of --repeats counts; prints the ratio of samples/s (the target is >= 2x). --results writes
the table into bench/RESULTS.md.

    .venv/bin/python bench/bench_856.py [--steps 20] [--sharding table_wise,row_wise] [--out 856.json] [--pooling-scale 2.6]
        [--set train.ids_exchange=step ...]   (extra config overrides, e.g. the ids exchanged in the step)
    .venv/bin/python bench/bench_856.py --pooling-scale 2.6 --paired-against REV [--repeats 2] [--results]
        [--note-file NOTE.md]   (a paragraph recorded after the table: what the runs showed beyond it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit, record_results  # noqa: E402

ROWS_CAP = 20_000
DIM = 16
# Share of the step that data_wait + comm_input may take, and the paired speed-up targeted.
TARGET_SHARE, TARGET_RATIO = 0.10, 2.0
RESULTS_SECTION = "856 tables, ~12,600 ids per sample"


def config(sharding: str, steps: int, batch: int, extra: tuple[str, ...] = (), pooling_scale: float = 1.0):
    """The prod_856-shaped config, composed from the conf/ of the neocfg that is imported (this tree's or, in a
    paired child, the other revision's)."""
    import neocfg
    from hydra import compose, initialize_config_dir

    from neocfg.config.schema import load, register

    register()
    overrides = ["model=prod_856", "hardware=cpu_local", "mode=train", f"train.steps={steps}",
                 f"train.batch_size={batch}", "train.eval_batches=0", f"train.log_every={steps}",
                 f"planner.sharding_types=[{sharding}]", "model.interaction=dcn", "model.dcn_low_rank_dim=16",
                 "model.dcn_num_layers=1", "model.bottom_mlp=[64,16]", "model.top_mlp=[64,1]",
                 "model.planning_only=false", *extra]
    conf = Path(neocfg.__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = load(compose("config", overrides=overrides))
    tables = [dataclasses.replace(t, embedding_dim=DIM, num_embeddings=min(t.num_embeddings, ROWS_CAP),
                                  pooling_factor=t.pooling_factor * pooling_scale)
              for t in cfg.model.tables]
    train = cfg.train
    if hasattr(train, "divergence_factor"):   # a speed run: Zipf-heavy tables at lr 0.05 spike the loss early
        train = dataclasses.replace(train, divergence_factor=0.0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tables=tables), train=train)


def run_one(sharding: str, a, run_dir: Path) -> dict[str, Any]:
    """Train one sharding type with the imported neocfg's mode=train entry; its samples/s and breakdown."""
    import neocfg

    # (by file: an editable install's finder would hand out another tree's neocfg.contract)
    if (Path(neocfg.__file__).parent / "contract.py").exists():
        from neocfg.contract import train as run
    else:   # revisions before neocfg.contract
        from neocfg.runtime.run import run
    m = run(config(sharding, a.steps, a.batch, tuple(a.set), a.pooling_scale), run_dir)
    m = m if isinstance(m, dict) else dataclasses.asdict(m)
    b = m["breakdown_ms"]
    share = (b["data_wait"] + b["comm_input"]) / m["measured_step_ms"]
    return {"sharding": sharding, "samples_per_s": m["samples_per_s"], "measured_step_ms": m["measured_step_ms"],
            "predicted_step_ms": m["predicted_step_ms"], "data_wait_plus_comm_input_share": share,
            "breakdown_ms": b}


def child_args(a, sharding: str, out: Path) -> list[str]:
    return ["--child", str(out), "--sharding", sharding, "--steps", str(a.steps), "--batch", str(a.batch),
            "--pooling-scale", str(a.pooling_scale), *(["--set", *a.set] if a.set else [])]


def run_in_tree(tree: Path, a, sharding: str, tmp: Path) -> dict[str, Any]:
    """One run as its own process, importing neocfg from `tree`."""
    out = tmp / f"{tree.name}_{sharding}_{len(list(tmp.iterdir()))}.json"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *child_args(a, sharding, out)],
                       cwd=tmp, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-4:])
        raise SystemExit(f"bench_856: run in {tree} failed (exit {r.returncode}): {tail}")
    return json.loads(out.read_text())


def paired(a) -> None:
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        old = tmp / "against"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), a.paired_against],
                       check=True, capture_output=True)
        try:
            trees = {"this": REPO, a.paired_against: old}
            cases = []
            for sharding in a.sharding.split(","):
                runs: dict[str, list[dict]] = {n: [] for n in trees}
                for rep in range(a.repeats):
                    order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
                    for n in order:
                        runs[n].append(run_in_tree(trees[n], a, sharding, tmp))
                    print(f"{sharding} repeat {rep + 1}/{a.repeats}: " + ", ".join(
                        f"{n} {runs[n][-1]['samples_per_s']:,.0f} samples/s "
                        f"({runs[n][-1]['data_wait_plus_comm_input_share']:.1%} data_wait + comm_input)"
                        for n in trees), file=sys.stderr)
                best = {n: max(v, key=lambda r: r["samples_per_s"]) for n, v in runs.items()}
                ratio = best["this"]["samples_per_s"] / best[a.paired_against]["samples_per_s"]
                print(f"{sharding}: this / {a.paired_against} = {ratio:.2f}x (target >= {TARGET_RATIO}x)",
                      file=sys.stderr)
                cases.append({"sharding": sharding, "best": best, "ratio": ratio, "runs": runs})
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], capture_output=True)
    if a.results:
        record_results(RESULTS_SECTION, markdown(cases, a))
    emit({"bench": "prod_856_shaped_cpu_local_paired", "against": a.paired_against, "rows_cap": ROWS_CAP,
          "dim": DIM, "batch_per_rank": a.batch, "steps": a.steps, "pooling_scale": a.pooling_scale,
          "repeats": a.repeats, "cases": cases}, a.out)


def markdown(cases: list[dict], a) -> str:
    rows = ["| sharding | this checkout | paired revision | ratio | runs (this / paired) | data_wait + comm_input "
            "(this / paired) | step ms (this) | largest terms (this, ms) |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for c in cases:
        new, old = c["best"]["this"], c["best"][a.paired_against]
        top = sorted(((k, v) for k, v in new["breakdown_ms"].items() if k != "total"), key=lambda kv: -kv[1])[:5]
        runs = " / ".join(", ".join(f"{r['samples_per_s']:,.0f}" for r in c["runs"][n])
                          for n in ("this", a.paired_against))
        rows.append(f"| {c['sharding']} | {new['samples_per_s']:,.0f} | {old['samples_per_s']:,.0f} | "
                    f"{c['ratio']:.2f}x | {runs} | {new['data_wait_plus_comm_input_share']:.1%} / "
                    f"{old['data_wait_plus_comm_input_share']:.1%} | {new['measured_step_ms']:.0f} | "
                    + ", ".join(f"{k} {v:.0f}" for k, v in top) + " |")
    return "\n".join([
        f"prod_856's 856 tables at dim {DIM}, rows capped at {ROWS_CAP:,}, every pooling factor x{a.pooling_scale} "
        f"(about 12,600 ids per sample), Zipf ids as the preset has them; 2 gloo ranks, batch {a.batch} per rank, "
        f"default synthetic stream (generated in the prefetch thread), {a.steps} steps. Each run its own process "
        "(mode=train's entry, planning included, samples/s of the timed steps), this checkout against the revision "
        f"named in the command (checked out in a temporary worktree), interleaved, best of {a.repeats}. Targets: "
        f"ratio >= {TARGET_RATIO}x, data_wait + comm_input <= {TARGET_SHARE:.0%} of the step. `prefetch` is the "
        "prefetch thread's CPU per step on the rank's core (batch generation and, where prefetched, the ids "
        "exchange's host work). The machine was shared (other jobs outside the CPU lock): compare the runs' spread "
        "before the ratio.", "", *rows, *(["", Path(a.note_file).read_text().strip()] if a.note_file else [])])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sharding", default="table_wise,row_wise")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--pooling-scale", type=float, default=1.0,
                    help="every table's pooling factor times this (2.6: about 12,600 ids per sample)")
    ap.add_argument("--paired-against", metavar="REV", help="also run git revision REV, interleaved, as processes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--results", action="store_true", help="write the paired table into bench/RESULTS.md")
    ap.add_argument("--note-file", help="with --results: a paragraph recorded after the table, from this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.child:
        with tempfile.TemporaryDirectory() as tmp:
            Path(a.child).write_text(json.dumps(run_one(a.sharding, a, Path(tmp) / "run")))
        return
    if a.paired_against:
        paired(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in a.sharding.split(","):
            row = run_one(sharding, a, Path(tmp) / sharding)
            rows.append(row)
            b = row["breakdown_ms"]
            print(f"{sharding}: {row['samples_per_s']:.0f} samples/s, step {row['measured_step_ms']:.0f} ms, "
                  f"data_wait {b['data_wait']:.1f} ms + comm_input {b['comm_input']:.1f} ms = "
                  f"{row['data_wait_plus_comm_input_share']:.1%} (target <= {TARGET_SHARE:.0%})", file=sys.stderr)
    emit({"bench": "prod_856_shaped_cpu_local", "rows_cap": ROWS_CAP, "dim": DIM, "batch_per_rank": a.batch,
          "steps": a.steps, "overrides": a.set, "pooling_scale": a.pooling_scale, "runs": rows}, a.out)


if __name__ == "__main__":
    main()
