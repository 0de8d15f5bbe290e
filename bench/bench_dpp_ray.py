"""DPP on Ray against local, as a user runs it: whole `neocfg mode=train` runs, one process tree each.

    flock /work/cpu.lock .venv/bin/python bench/bench_dpp_ray.py [--steps 1000] [--reps 2] [--record]

The same 2-rank dlrm_tiny job on the same Parquet data (written once by `mode=gen_data dsi=parquet_local`), with
`dsi.backend=local` and `dsi.backend=ray` (the run's own Ray, dsi.ray.address=null), interleaved, best of `--reps`
per backend: the trainer's samples/s and its steady-state data stall (metrics.json). Ray start-up is not in the
samples/s (the runtime times the steps). Prints the ratio ray/local; --record writes the `## DPP on Ray vs local`
section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import record_results  # noqa: E402

NEOCFG = [sys.executable, "-m", "neocfg"]
# Done-when of the Ray backend: at least this share of local's samples/s, at most this stall.
TARGET_RATIO = 0.95
TARGET_STALL = 0.02


def run(cwd: Path, *overrides: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*NEOCFG, *overrides], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"neocfg {' '.join(overrides)} failed ({r.returncode}): {r.stderr[-2000:]}")
    runs = sorted((cwd / "outputs").rglob("metrics.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(runs[-1].read_text()) if runs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="timed steps per run (1,000: about 6 s of steps)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=262144)
    ap.add_argument("--record", action="store_true", help="write the section of bench/RESULTS.md")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "bench_dpp_ray.json")
    ap.add_argument("--record-from", type=Path, help="only write the section from this earlier run's JSON")
    args = ap.parse_args()
    if args.record_from:
        record(json.loads(args.record_from.read_text()))
        return
    with tempfile.TemporaryDirectory(prefix="bench_dpp_ray_") as tmp:
        cwd = Path(tmp)
        data = cwd / "ds"
        common = ["dsi=parquet_local", f"dsi.path={data}", "planner.algorithm=greedy"]
        run(cwd, "mode=gen_data", *common, f"dsi.num_samples={args.samples}")
        runs: dict[str, list[dict]] = {"local": [], "ray": []}
        for rep in range(args.reps):
            for backend in ("local", "ray"):
                t0 = time.perf_counter()
                m = run(cwd, "mode=train", *common, f"dsi.backend={backend}", f"train.steps={args.steps}",
                        "train.eval_batches=1")
                row = {"samples_per_s": m["samples_per_s"], "stall": m["data_stall_fraction"],
                       "duplicates": m["duplicate_samples"], "wall_s": time.perf_counter() - t0}
                runs[backend].append(row)
                print(f"rep {rep} {backend:5s}: {row['samples_per_s']:,.0f} samples/s, stall "
                      f"{100 * row['stall']:.2f}%, duplicates {row['duplicates']}, run {row['wall_s']:.0f} s",
                      flush=True)
    best = {b: max(rs, key=lambda r: r["samples_per_s"]) for b, rs in runs.items()}
    ratio = best["ray"]["samples_per_s"] / best["local"]["samples_per_s"]
    ok = ratio >= TARGET_RATIO and best["ray"]["stall"] <= TARGET_STALL
    print(f"ray/local samples/s: {ratio:.3f} (target >= {TARGET_RATIO}); ray stall {100 * best['ray']['stall']:.2f}% "
          f"(target <= {100 * TARGET_STALL:.0f}%): {'met' if ok else 'NOT met'}")
    out = {"steps": args.steps, "reps": args.reps, "samples": args.samples, "runs": runs, "best": best,
           "ray_over_local": ratio, "met": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.record:
        record(out)


def record(out: dict) -> None:
    """Write the section of bench/RESULTS.md from a run's JSON."""
    runs, best, ratio, ok = out["runs"], out["best"], out["ray_over_local"], out["met"]
    lines = [f"The same 2-rank dlrm_tiny `mode=train` job on the "
             f"same Parquet data ({out['samples']:,} samples), `dsi.backend=local` and `dsi.backend=ray` (the run's "
             f"own Ray), interleaved, best of {out['reps']}; measured by `bench/bench_dpp_ray.py --steps {out['steps']} "
             f"--reps {out['reps']}` (each run's number shows the machine's noise; 2 shared cores).", "",
             "| backend | samples/s (each run) | best | stall at best | duplicates |", "|---|---|---|---|---|"]
    for b in ("local", "ray"):
        each = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs[b])
        lines.append(f"| {b} | {each} | {best[b]['samples_per_s']:,.0f} | {100 * best[b]['stall']:.2f}% | "
                     f"{sum(r['duplicates'] for r in runs[b])} |")
    lines += ["", f"Ray / local: **{ratio:.3f}x** samples/s (target >= {TARGET_RATIO}), Ray stall "
                  f"{100 * best['ray']['stall']:.2f}% (target <= {100 * TARGET_STALL:.0f}%): "
                  f"{'met' if ok else 'not met'}.",
              "", f"In short: on Ray, a 2-rank job trains at {ratio:.3f}x local's samples/s with a "
                  f"{100 * best['ray']['stall']:.2f}% stall (best of {out['reps']}, interleaved)."]
    record_results("DPP on Ray vs local", "\n".join(lines))


if __name__ == "__main__":
    main()
