"""Planner benchmark: every model preset on 8, 16 and 128 devices (ZionEX nodes), greedy vs ILP, side by side.

    .venv/bin/python bench/bench_planner.py [--quick] [--out bench/results] [--time-limit 45] [--solvers cbc highs]
    .venv/bin/python bench/bench_planner.py --scale [--solvers cbc]
    .venv/bin/python bench/bench_planner.py --quick --restricted

Prints per case: wall and CPU seconds (options + solver; CPU counts the solver's process too) of each algorithm,
their objectives (estimated step ms), the ILP's proven lower bound and gap, the embedding-only gap (the dense part
is the same for every plan), ILP/greedy and where the kept placement came from. With several --solvers, one ILP row
per solver (same instance, run one after the other). Writes <out>/bench_planner.json and .png. --quick: 8 and 128
devices, 15 s solver limit. --scale: the ILP on growing tables x devices (up to prod_4096 on 512 devices), time
against tables x devices in <out>/bench_planner_scale.json and .png. --restricted: per case also the ILP with each
restriction of planner.sharding_types that changes the collectives issued (each type alone, each collective group;
neocfg.planner.fixed.restricted_sharding_types), and checks that no restricted plan beats the
full run's lower bound, and the full run's plan is within its gap of the best restricted one (printed, in the JSON,
and the exit status is 1 if it fails anywhere).
"""

from __future__ import annotations

import argparse
import json
import resource
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
from neocfg.planner.fixed import restricted_sharding_types  # noqa: E402
from neocfg.planner.pipeline import plan_placement  # noqa: E402

NODES = {8: 1, 16: 2, 128: 16}
DEVICES_PER_NODE = 8
# --scale: (model, devices), growing tables x devices up to the issue-12 target (4,096 tables on 512 devices).
SCALE = [("dcnv2_mlperf", 16), ("dcnv2_mlperf", 128), ("prod_856", 128), ("prod_856", 256), ("prod_4096", 256),
         ("prod_4096", 512)]


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    objective_ms: Optional[float]
    lower_bound_ms: Optional[float]
    gap: Optional[float]
    embedding_gap: Optional[float]
    status: str
    placement_source: str = "-"
    error: Optional[str] = None


@dataclass
class Restricted:
    """The ILP under each restriction of planner.sharding_types (objective ms, None where nothing fits) against the
    full run's bound and plan (per solver)."""

    objective_ms: dict[str, Optional[float]]          # by restriction ("table_wise,column_wise,...")
    best: Optional[str]
    bound_holds: dict[str, bool]                       # by solver: full bound <= every restricted plan
    within_gap: dict[str, bool]                        # by solver: full plan within its gap of the best restricted

    @property
    def restricted_best_ms(self) -> Optional[float]:
        return None if self.best is None else self.objective_ms[self.best]

    @property
    def ok(self) -> bool:
        return all(self.bound_holds.values()) and all(self.within_gap.values())


@dataclass
class Case:
    model: str
    devices: int
    greedy: Run
    ilp: dict[str, Run]     # by solver
    restricted: Optional[Restricted] = None

    def ratio(self, solver: str) -> Optional[float]:
        i = self.ilp[solver]
        if i.objective_ms and self.greedy.objective_ms:
            return i.objective_ms / self.greedy.objective_ms
        return None


def compose_cfg(overrides: list[str]):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return load(compose("config", overrides=overrides))


def cpu_now() -> float:
    """CPU seconds of this process and its finished children (CBC runs as a child process)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_one(model: str, devices: int, algorithm: str, time_limit: float, solver: str = "cbc",
            extra: tuple[str, ...] = ()) -> Run:
    nodes = devices // DEVICES_PER_NODE
    cfg = compose_cfg([f"model={model}", "hardware=zionex_1node", f"hardware.nodes={nodes}",
                       f"hardware.name=zionex_{nodes}node", f"planner.solver={solver}",
                       f"planner.algorithm={algorithm}", f"planner.time_limit_s={time_limit}", *extra])
    t0, c0 = time.perf_counter(), cpu_now()
    try:
        plan = plan_placement(cfg)
    except NeocfgError as exc:
        return Run(time.perf_counter() - t0, cpu_now() - c0, None, None, None, None, "infeasible", error=str(exc))
    s = plan.solver
    emb = s.objective_ms - plan.estimate.dense_ms
    return Run(time.perf_counter() - t0, cpu_now() - c0, s.objective_ms, s.lower_bound_ms, s.gap,
               (s.objective_ms - s.lower_bound_ms) / emb if emb > 0 else 0.0, s.status, s.placement_source)


# Float rounding between the bound's terms and the cost model's (tests/test_planner_bound.py: ROUND).
ROUND = 1 + 1e-9


def check_restricted(model: str, devices: int, limit: float, solver: str, full: dict[str, Run]) -> Restricted:
    """The ILP under each restriction; every restricted plan is a plan of the full option space."""
    objective: dict[str, Optional[float]] = {}
    for kinds in restricted_sharding_types():
        name = ",".join(k.value for k in kinds)
        objective[name] = run_one(model, devices, "ilp", limit, solver, (f"planner.sharding_types=[{name}]",)
                                  ).objective_ms
    found = {k: v for k, v in objective.items() if v is not None}
    best = min(found, key=found.__getitem__) if found else None
    holds, within = {}, {}
    for sv, r in full.items():
        if r.objective_ms is None or r.lower_bound_ms is None:
            # nothing planned in full: no restricted run may have found a plan either
            holds[sv] = within[sv] = not found
            continue
        holds[sv] = all(r.lower_bound_ms <= v * ROUND for v in found.values())
        within[sv] = best is None or r.objective_ms * (1 - r.gap) <= found[best] * ROUND
    return Restricted(objective, best, holds, within)


def fmt(x: Optional[float], spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 128 devices only, 15 s solver limit")
    ap.add_argument("--scale", action="store_true", help="ILP time against tables x devices (up to 4096 x 512)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--time-limit", type=float, default=None, help="ILP time limit, s (default 45, quick 15)")
    ap.add_argument("--models", nargs="*", default=None, help="model presets (default: all in conf/model)")
    ap.add_argument("--devices", nargs="*", type=int, default=None, choices=sorted(NODES))
    ap.add_argument("--solvers", nargs="*", default=["cbc"], choices=["cbc", "highs"])
    ap.add_argument("--restricted", action="store_true",
                    help="also each restriction of planner.sharding_types; check the full run's bound against them")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scale:
        scale(args.solvers, args.time_limit or 45.0, out)
        return
    models = args.models or sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml")
                                   if p.stem != "prod_4096")   # prod_4096 is --scale's
    sizes = args.devices or ([8, 128] if args.quick else [8, 16, 128])
    limit = args.time_limit or (15.0 if args.quick else 45.0)
    head = (f"{'model':<20}{'dev':>4} | {'greedy s':>8} {'greedy ms':>10} | {'solver':>6} {'ilp s':>6} {'cpu s':>6}"
            f" {'ilp ms':>10} {'bound ms':>10} {'gap':>6} {'emb gap':>7} | {'ilp/greedy':>10}  status, placement")
    print(head)
    print("-" * len(head))
    cases = []
    for model in models:
        for devices in sizes:
            g = run_one(model, devices, "greedy", limit)
            c = Case(model, devices, g, {sv: run_one(model, devices, "ilp", limit, sv) for sv in args.solvers})
            if args.restricted:
                c.restricted = check_restricted(model, devices, limit, args.solvers[0], c.ilp)
            cases.append(c)
            for sv, i in c.ilp.items():
                status = f"{i.status}, {i.placement_source}" if i.error is None else f"{i.error[:60]}..."
                print(f"{model:<20}{devices:>4} | {g.seconds:>8.2f} {fmt(g.objective_ms, '10.4f')} | {sv:>6}"
                      f" {i.seconds:>6.2f} {i.cpu_seconds:>6.2f} {fmt(i.objective_ms, '10.4f')}"
                      f" {fmt(i.lower_bound_ms, '10.4f')} {fmt(None if i.gap is None else 100 * i.gap, '5.2f')}%"
                      f" {fmt(None if i.embedding_gap is None else 100 * i.embedding_gap, '6.2f')}%"
                      f" | {fmt(c.ratio(sv), '10.4f')}  {status}", flush=True)
            if c.restricted is not None:
                r = c.restricted
                best = "-" if r.best is None else f"{r.restricted_best_ms:.4f} ms ({r.best})"
                print(f"{'':<24}restricted: best {best}; full bound <= all {len(r.objective_ms)} restricted plans: "
                      f"{'yes' if all(r.bound_holds.values()) else 'NO'}; full plan within its gap of the best: "
                      f"{'yes' if all(r.within_gap.values()) else 'NO'}", flush=True)
    (out / "bench_planner.json").write_text(json.dumps(
        {"time_limit_s": limit, "cases": [{**asdict(c), "ilp_over_greedy": {sv: c.ratio(sv) for sv in c.ilp}}
                                          for c in cases]}, indent=1))
    save_png(cases, out / "bench_planner.png")
    print(f"results written to {out / 'bench_planner.json'} and {out / 'bench_planner.png'}")
    if args.restricted:
        failed = [f"{c.model} x {c.devices}" for c in cases if c.restricted is not None and not c.restricted.ok]
        print(f"restricted sharding types: {'every case holds' if not failed else 'FAILS on ' + ', '.join(failed)}"
              f" ({len(cases)} cases)")
        if failed:
            sys.exit(1)


def scale(solvers: list[str], limit: float, out: Path) -> None:
    head = (f"{'model':<14}{'tables':>7}{'dev':>5}{'tables x dev':>13} | {'solver':>6} {'wall s':>7} {'cpu s':>7}"
            f" {'ilp ms':>10} {'bound ms':>10} {'gap':>6}  status, placement")
    print(head)
    print("-" * len(head))
    rows = []
    for model, devices in SCALE:
        tables = len(compose_cfg([f"model={model}"]).model.tables)
        for sv in solvers:
            r = run_one(model, devices, "ilp", limit, sv)
            rows.append({"model": model, "tables": tables, "devices": devices, "solver": sv, **asdict(r)})
            print(f"{model:<14}{tables:>7}{devices:>5}{tables * devices:>13,} | {sv:>6} {r.seconds:>7.1f}"
                  f" {r.cpu_seconds:>7.1f} {fmt(r.objective_ms, '10.4f')} {fmt(r.lower_bound_ms, '10.4f')}"
                  f" {fmt(None if r.gap is None else 100 * r.gap, '5.2f')}%  {r.status}, {r.placement_source}",
                  flush=True)
    (out / "bench_planner_scale.json").write_text(json.dumps({"time_limit_s": limit, "runs": rows}, indent=1))
    save_scale_png(rows, out / "bench_planner_scale.png")
    print(f"results written to {out / 'bench_planner_scale.json'} and {out / 'bench_planner_scale.png'}")


def save_scale_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for sv in sorted({r["solver"] for r in rows}):
        mine = sorted((r for r in rows if r["solver"] == sv), key=lambda r: r["tables"] * r["devices"])
        x = [r["tables"] * r["devices"] for r in mine]
        ax.plot(x, [r["seconds"] for r in mine], "o-", label=f"{sv}: wall s")
        ax.plot(x, [r["cpu_seconds"] for r in mine], "s--", label=f"{sv}: CPU s")
        for r in mine:
            gap = "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
            ax.annotate(f"{r['tables']}x{r['devices']}\ngap {gap}", (r["tables"] * r["devices"], r["seconds"]),
                        fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.axhline(60, color="k", ls=":", lw=1, label="60 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tables x devices")
    ax.set_ylabel("seconds (options + solver + placement)")
    ax.set_title("ILP planner: time against size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save_png(cases: list[Case], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solvers = list(cases[0].ilp) if cases else []
    ok = [c for c in cases if all(i.gap is not None for i in c.ilp.values())]
    if not ok:
        return
    labels = [f"{c.model} {c.devices}" for c in ok]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(ok) + 3), 7), sharex=True)
    x = list(range(len(ok)))
    w = 0.8 / (1 + len(solvers))
    for j, sv in enumerate(solvers):
        a.bar([i + j * w for i in x], [100 * c.ilp[sv].gap for c in ok], w, label=f"ILP ({sv}) gap, step time")
    a.set_ylabel("gap to proven bound, %")
    a.legend(fontsize=8)
    b.bar(x, [c.greedy.seconds for c in ok], w, label="greedy")
    for j, sv in enumerate(solvers):
        b.bar([i + (j + 1) * w for i in x], [c.ilp[sv].seconds for c in ok], w, label=f"ILP ({sv})")
    b.set_ylabel("wall seconds")
    b.set_xticks(x)
    b.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
