"""Planner benchmark: every model preset on 8, 16 and 128 devices (ZionEX or H100 nodes), greedy vs ILP, side by side.

    .venv/bin/python bench/bench_planner.py [--quick] [--out bench/results] [--time-limit 45] [--solvers cbc highs]
                                            [--hardware zionex h100]
    .venv/bin/python bench/bench_planner.py --scale [--solvers cbc]
    .venv/bin/python bench/bench_planner.py --quick --restricted
    .venv/bin/python bench/bench_planner.py --devices 16 128 --max-gap 0.02 --record

Prints per case: wall and CPU seconds (options + solver; CPU counts the solver's process too) of each algorithm,
their objectives (estimated step ms), the ILP's proven lower bound and gap, the embedding-only gap (the dense part
is the same for every plan), ILP/greedy and where the kept placement came from. With several --solvers, one ILP row
per solver (same instance, run one after the other). Writes <out>/bench_planner.json and .png. --quick: 8 and 128
devices, 15 s solver limit (default: planner.time_limit_s). --hardware: the presets, zionex_<n>node
(zionex_1node/2node/16node for 8/16/128 devices) and h100_8node with hardware.nodes=<n>. --scale: the ILP on growing tables x devices (up to prod_4096 on 512 devices), time
against tables x devices in <out>/bench_planner_scale.json and .png. --restricted: per case also the ILP under each
restriction of the option space (neocfg.planner.fixed.restrictions: each sharding type alone and each collective group,
each memory tier and each weights precision alone or left out), and checks that no restricted plan beats the full
run's lower bound and that the full run's plan is within its gap of the best restricted one (printed, in the JSON,
and the exit status is 1 if it fails anywhere). --max-gap G: checks that every case that fits ends at a gap of at most
G within its time limit (ILP wall seconds, options and assembly included, at most the limit + TIME_SLACK_S); the exit
status is 1 if one does not.
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
from neocfg.planner.fixed import restrictions  # noqa: E402
from neocfg.planner.pipeline import plan_placement  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import RESULTS, record_results  # noqa: E402

NODES = {8: 1, 16: 2, 128: 16}
DEVICES_PER_NODE = 8
# --hardware: the Hydra overrides of each family's preset for that many nodes.
HARDWARE = {"zionex": lambda nodes: [f"hardware=zionex_{nodes}node"],
            "h100": lambda nodes: ["hardware=h100_8node", f"hardware.nodes={nodes}"]}
# --scale: (model, devices), growing tables x devices up to 4,096 tables on 512 devices.
SCALE = [("dcnv2_mlperf", 16), ("dcnv2_mlperf", 128), ("prod_856", 128), ("prod_856", 256), ("prod_4096", 256),
         ("prod_4096", 512)]
# --max-gap: seconds a run may take past planner.time_limit_s (CBC stops on whole seconds; the cost model is built
# and the plan assembled outside the solver's budget).
TIME_SLACK_S = 2.0


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
    hardware: str
    greedy: Run
    ilp: dict[str, Run]     # by solver
    limit_s: float          # the ILP's time limit
    restricted: Optional[Restricted] = None

    def misses(self, max_gap: float) -> list[str]:
        """Why this case fails --max-gap (none where it does not fit: there is no plan to close)."""
        out = []
        for sv, i in self.ilp.items():
            if i.gap is None:
                continue
            if i.gap > max_gap:
                out.append(f"{self.model} x {self.devices} ({sv}): gap {100 * i.gap:.2f}%")
            if i.seconds > self.limit_s + TIME_SLACK_S:
                out.append(f"{self.model} x {self.devices} ({sv}): {i.seconds:.1f} s, limit {self.limit_s:g} s")
        return out

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


def overrides(model: str, devices: int, hardware: str, time_limit: Optional[float]) -> list[str]:
    limit = [] if time_limit is None else [f"planner.time_limit_s={time_limit}"]
    return [f"model={model}", *HARDWARE[hardware](devices // DEVICES_PER_NODE), *limit]


def run_one(model: str, devices: int, algorithm: str, time_limit: Optional[float], solver: str = "cbc",
            extra: tuple[str, ...] = (), hardware: str = "zionex") -> Run:
    cfg = compose_cfg([*overrides(model, devices, hardware, time_limit), f"planner.solver={solver}",
                       f"planner.algorithm={algorithm}", *extra])
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


def check_restricted(model: str, devices: int, hardware: str, limit: Optional[float], solver: str,
                     full: dict[str, Run]) -> Restricted:
    """The ILP under each restriction; every restricted plan is a plan of the full option space."""
    pl = compose_cfg(overrides(model, devices, hardware, limit)).planner
    objective: dict[str, Optional[float]] = {}
    for key, values in restrictions(pl.sharding_types, pl.memory_tiers, pl.weights_dtypes):
        name = f"{key}=[{','.join(values)}]"
        objective[name] = run_one(model, devices, "ilp", limit, solver, (name,), hardware).objective_ms
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
    ap.add_argument("--hardware", nargs="*", default=["zionex"], choices=sorted(HARDWARE))
    ap.add_argument("--restricted", action="store_true",
                    help="also each restriction of the option space; check the full run's bound against them")
    ap.add_argument("--max-gap", type=float, default=None,
                    help="check that every case that fits ends at a gap of at most this within its time limit")
    ap.add_argument("--record", action="store_true",
                    help=f"write the cases' gaps into bench/RESULTS.md, section '{RESULTS_SECTION}' (rows of"
                         " other cases kept)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scale:
        scale(args.solvers, args.time_limit or 45.0, out)
        return
    models = args.models or sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    sizes = args.devices or ([8, 128] if args.quick else [8, 16, 128])
    limit = args.time_limit or (15.0 if args.quick else None)
    head = (f"{'model':<20}{'hardware':>8}{'dev':>5} | {'greedy s':>8} {'greedy ms':>10} | {'solver':>6} {'ilp s':>6}"
            f" {'cpu s':>6} {'ilp ms':>10} {'bound ms':>10} {'gap':>6} {'emb gap':>7} | {'ilp/greedy':>10}  status, placement")
    print(head)
    print("-" * len(head))
    cases = []
    for model, hw, devices in ((m, h, d) for m in models for h in args.hardware for d in sizes):
        g = run_one(model, devices, "greedy", limit, hardware=hw)
        c = Case(model, devices, hw, g, {sv: run_one(model, devices, "ilp", limit, sv, hardware=hw)
                                         for sv in args.solvers},
                 limit or compose_cfg(overrides(model, devices, hw, None)).planner.time_limit_s)
        if args.restricted:
            c.restricted = check_restricted(model, devices, hw, limit, args.solvers[0], c.ilp)
        cases.append(c)
        for sv, i in c.ilp.items():
            status = f"{i.status}, {i.placement_source}" if i.error is None else f"{i.error[:60]}..."
            print(f"{model:<20}{hw:>8}{devices:>5} | {g.seconds:>8.2f} {fmt(g.objective_ms, '10.4f')} | {sv:>6}"
                  f" {i.seconds:>6.2f} {i.cpu_seconds:>6.2f} {fmt(i.objective_ms, '10.4f')}"
                  f" {fmt(i.lower_bound_ms, '10.4f')} {fmt(None if i.gap is None else 100 * i.gap, '5.2f')}%"
                  f" {fmt(None if i.embedding_gap is None else 100 * i.embedding_gap, '6.2f')}%"
                  f" | {fmt(c.ratio(sv), '10.4f')}  {status}", flush=True)
        if c.restricted is not None:
            r = c.restricted
            best = "-" if r.best is None else f"{r.restricted_best_ms:.4f} ms ({r.best})"
            print(f"{'':<33}restricted: best {best}; full bound <= all {len(r.objective_ms)} restricted plans: "
                  f"{'yes' if all(r.bound_holds.values()) else 'NO'}; full plan within its gap of the best: "
                  f"{'yes' if all(r.within_gap.values()) else 'NO'}", flush=True)
    (out / "bench_planner.json").write_text(json.dumps(
        {"time_limit_s": limit or "planner.time_limit_s",
         "cases": [{**asdict(c), "ilp_over_greedy": {sv: c.ratio(sv) for sv in c.ilp}} for c in cases]}, indent=1))
    save_png(cases, out / "bench_planner.png")
    print(f"results written to {out / 'bench_planner.json'} and {out / 'bench_planner.png'}")
    check, missed = None, []
    if args.max_gap is not None:
        missed = [m for c in cases for m in c.misses(args.max_gap)]
        check = (f"every case that fits ends at a gap of at most {100 * args.max_gap:g}% within its time limit: "
                 + ("yes" if not missed else "NO (" + "; ".join(missed) + ")") + f" ({len(cases)} cases)")
        print(check)
    if args.record:
        record(cases, check)
    if args.restricted:
        failed = [f"{c.model} x {c.hardware} x {c.devices}" for c in cases
                  if c.restricted is not None and not c.restricted.ok]
        print(f"restrictions: {'every case holds' if not failed else 'FAILS on ' + ', '.join(failed)}"
              f" ({len(cases)} cases)")
        if failed:
            sys.exit(1)
    if missed:
        sys.exit(1)


RESULTS_SECTION = "Planner bound and gaps"
RESULTS_COLUMNS = ("model", "hardware", "devices", "solver", "ILP ms", "bound ms", "gap", "status, placement",
                   "ILP s (limit)", "restricted runs")


def record(cases: list[Case], check: Optional[str] = None) -> None:
    """This run's cases as rows of bench/RESULTS.md's section (a row per model x hardware x devices x solver); rows of
    cases not run this time are kept (the section is filled by several runs)."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    start = text.find(f"## {RESULTS_SECTION}\n")
    rows: dict[tuple[str, ...], str] = {}
    if start >= 0:
        end = text.find("\n## ", start + 1)
        for line in text[start:end if end >= 0 else len(text)].splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == len(RESULTS_COLUMNS) and cells[0] != "model":
                rows[tuple(cells[:4])] = line
    for c in cases:
        for sv, i in c.ilp.items():
            held = "-" if c.restricted is None else (
                f"{sum(v is not None for v in c.restricted.objective_ms.values())} of"
                f" {len(c.restricted.objective_ms)} planned, bound held: {'yes' if c.restricted.bound_holds[sv] else 'NO'}")
            cells = (c.model, c.hardware, str(c.devices), sv, fmt(i.objective_ms, ".4f"), fmt(i.lower_bound_ms, ".4f"),
                     "-" if i.gap is None else f"{100 * i.gap:.2f}%",
                     f"{i.status}, {i.placement_source}" if i.error is None else "does not fit",
                     f"{i.seconds:.1f} ({c.limit_s:g})", held)
            rows[cells[:4]] = "| " + " | ".join(cells) + " |"
    body = ["Gap: (plan - bound) / plan of the step time; the bound holds for every plan of the enumerated options. "
            "Time limit: planner.time_limit_s unless the command sets --time-limit. The command is the last run's; "
            "rows of earlier runs of this bench (other models, hardware or device counts) are kept.", "",
            "| " + " | ".join(RESULTS_COLUMNS) + " |", "|" + "---|" * len(RESULTS_COLUMNS)]
    body += [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], int(k[2]), k[3]))]
    if check is not None:
        body += ["", f"Checked by this run (--max-gap): {check}."]
    record_results(RESULTS_SECTION, "\n".join(body))


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
