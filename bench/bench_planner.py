"""Planner benchmark: every model preset on 8, 16 and 128 devices (ZionEX nodes), greedy vs ILP, side by side.

    .venv/bin/python bench/bench_planner.py [--quick] [--out bench/results] [--time-limit 45]

Prints per case: wall seconds (options + solver) of each algorithm, their objectives (estimated step ms), the ILP's
proven lower bound and gap, the embedding-only gap (the dense part is the same for every plan), and ILP/greedy.
Writes <out>/bench_planner.json and <out>/bench_planner.png. --quick: 8 and 128 devices, 15 s solver limit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from neocfg.config.schema import load, register  # noqa: E402
from neocfg.errors import NeocfgError  # noqa: E402
from neocfg.planner.pipeline import plan_placement  # noqa: E402

NODES = {8: 1, 16: 2, 128: 16}


@dataclass
class Run:
    seconds: float
    objective_ms: Optional[float]
    lower_bound_ms: Optional[float]
    gap: Optional[float]
    embedding_gap: Optional[float]
    status: str
    error: Optional[str] = None


@dataclass
class Case:
    model: str
    devices: int
    greedy: Run
    ilp: Run

    @property
    def ratio(self) -> Optional[float]:
        if self.ilp.objective_ms and self.greedy.objective_ms:
            return self.ilp.objective_ms / self.greedy.objective_ms
        return None


def compose_cfg(overrides: list[str]):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return load(compose("config", overrides=overrides))


def run_one(model: str, devices: int, algorithm: str, time_limit: float) -> Run:
    cfg = compose_cfg([f"model={model}", "hardware=zionex_1node", f"hardware.nodes={NODES[devices]}",
                       f"hardware.name=zionex_{NODES[devices]}node",
                       f"planner.algorithm={algorithm}", f"planner.time_limit_s={time_limit}"])
    t0 = time.perf_counter()
    try:
        plan = plan_placement(cfg)
    except NeocfgError as exc:
        return Run(time.perf_counter() - t0, None, None, None, None, "infeasible", str(exc))
    s = plan.solver
    emb = s.objective_ms - plan.estimate.dense_ms
    return Run(time.perf_counter() - t0, s.objective_ms, s.lower_bound_ms, s.gap,
               (s.objective_ms - s.lower_bound_ms) / emb if emb > 0 else 0.0, s.status)


def fmt(x: Optional[float], spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 128 devices only, 15 s solver limit")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--time-limit", type=float, default=None, help="ILP time limit, s (default 45, quick 15)")
    ap.add_argument("--models", nargs="*", default=None, help="model presets (default: all in conf/model)")
    ap.add_argument("--devices", nargs="*", type=int, default=None, choices=sorted(NODES))
    args = ap.parse_args()
    models = args.models or sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    sizes = args.devices or ([8, 128] if args.quick else [8, 16, 128])
    limit = args.time_limit or (15.0 if args.quick else 45.0)
    head = (f"{'model':<20}{'dev':>4} | {'greedy s':>8} {'greedy ms':>10} | {'ilp s':>6} {'ilp ms':>10}"
            f" {'bound ms':>10} {'gap':>6} {'emb gap':>7} | {'ilp/greedy':>10}  status")
    print(head)
    print("-" * len(head))
    cases = []
    for model in models:
        for devices in sizes:
            g = run_one(model, devices, "greedy", limit)
            i = run_one(model, devices, "ilp", limit)
            c = Case(model, devices, g, i)
            cases.append(c)
            status = i.status if i.error is None else f"{i.error[:60]}..."
            print(f"{model:<20}{devices:>4} | {g.seconds:>8.2f} {fmt(g.objective_ms, '10.4f')} | {i.seconds:>6.2f}"
                  f" {fmt(i.objective_ms, '10.4f')} {fmt(i.lower_bound_ms, '10.4f')}"
                  f" {fmt(None if i.gap is None else 100 * i.gap, '5.2f')}%"
                  f" {fmt(None if i.embedding_gap is None else 100 * i.embedding_gap, '6.2f')}%"
                  f" | {fmt(c.ratio, '10.4f')}  {status}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_planner.json").write_text(json.dumps(
        {"time_limit_s": limit, "cases": [{**asdict(c), "ilp_over_greedy": c.ratio} for c in cases]}, indent=1))
    save_png(cases, out / "bench_planner.png")
    print(f"results written to {out / 'bench_planner.json'} and {out / 'bench_planner.png'}")


def save_png(cases: list[Case], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cases if c.ilp.gap is not None]
    if not ok:
        return
    labels = [f"{c.model} {c.devices}" for c in ok]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(ok) + 3), 7), sharex=True)
    x = list(range(len(ok)))
    a.bar([i - 0.2 for i in x], [100 * c.ilp.gap for c in ok], 0.4, label="ILP gap (step time)")
    a.bar([i + 0.2 for i in x], [100 * (c.ilp.embedding_gap or 0) for c in ok], 0.4, label="ILP gap (embedding part)")
    a.set_ylabel("gap to proven bound, %")
    a.legend(fontsize=8)
    b.bar([i - 0.2 for i in x], [c.greedy.seconds for c in ok], 0.4, label="greedy")
    b.bar([i + 0.2 for i in x], [c.ilp.seconds for c in ok], 0.4, label="ILP")
    b.set_ylabel("wall seconds")
    b.set_xticks(x)
    b.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
