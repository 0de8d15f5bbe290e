"""Collect one row per run of a sweep directory and write sweep_summary.{csv,md,png}.

Each run directory holds Hydra's `.hydra/overrides.yaml` and `.hydra/config.yaml`, neocfg's `status.json` (ok or the
one-line error), and whatever the mode wrote: `plan.json` (mode=plan, mode=train) and `metrics.json` (mode=train).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import yaml

from neocfg.errors import NeocfgError
from neocfg.plan import Plan
from neocfg.run_metrics import METRICS_FILE, RunMetrics
from neocfg.types import SweepMetric
from neocfg.units import GIB

STATUS_FILE = "status.json"
PLAN_FILE = "plan.json"
T = TypeVar("T")

# Metric columns, in table order; every one may be absent (None) for a run that did not produce it.
METRIC_COLUMNS: tuple[str, ...] = tuple(m.value for m in SweepMetric)


@dataclass(frozen=True)
class SweepRow:
    job: int
    run_dir: Path
    overrides: dict[str, str]
    fits: bool
    why: str
    metrics: dict[str, Optional[float]] = field(default_factory=dict)


def _parse_overrides(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        key, _, value = str(line).partition("=")
        out[key.lstrip("+~")] = value
    return out


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _plan_metrics(plan: Plan, hbm_gib: Optional[float]) -> dict[str, Optional[float]]:
    max_hbm_pct = None
    if plan.devices and hbm_gib:
        max_hbm_pct = 100.0 * max(d.hbm_bytes for d in plan.devices) / (hbm_gib * GIB)
    return {
        SweepMetric.step_ms.value: plan.estimate.step_ms, SweepMetric.samples_per_s.value: plan.estimate.samples_per_s,
        SweepMetric.max_hbm_pct.value: max_hbm_pct, SweepMetric.objective_ms.value: plan.solver.objective_ms,
        SweepMetric.lower_bound_ms.value: plan.solver.lower_bound_ms, SweepMetric.gap.value: plan.solver.gap,
        SweepMetric.solver_s.value: plan.solver.seconds,
        SweepMetric.dpp_workers.value: plan.dpp.workers if plan.dpp is not None else None,
    }


def _train_metrics(m: RunMetrics) -> dict[str, Optional[float]]:
    return {SweepMetric.measured_step_ms.value: m.measured_step_ms,
            SweepMetric.measured_samples_per_s.value: m.samples_per_s,
            SweepMetric.final_loss.value: m.final_loss, SweepMetric.eval_auc.value: m.eval_auc}


def _load(path: Path, load: Callable[[Path], T]) -> Optional[T]:
    """The run's record, or None where the file is missing or unreadable (a run that stopped early)."""
    try:
        return load(path)
    except NeocfgError:
        return None


def read_run(run_dir: Path) -> Optional[SweepRow]:
    """The row of one run directory, or None if it is not a neocfg run."""
    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").exists():
        return None
    overrides = _parse_overrides(yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or [])
    config = yaml.safe_load((hydra_dir / "config.yaml").read_text()) if (hydra_dir / "config.yaml").exists() else {}
    hbm_gib = ((config or {}).get("hardware") or {}).get("device", {}).get("hbm_gib")
    status = _read_json(run_dir / STATUS_FILE)
    if status is None:
        fits, why = False, "run did not finish (no status.json): crashed or interrupted"
    else:
        # One line per row: the reason, never a traceback (the run's own log has the details).
        fits, why = bool(status.get("ok")), (str(status.get("error") or "").strip().splitlines() or [""])[0]
    metrics: dict[str, Optional[float]] = dict.fromkeys(METRIC_COLUMNS)
    plan = _load(run_dir / PLAN_FILE, Plan.load)
    if plan is not None:
        metrics.update(_plan_metrics(plan, hbm_gib))
    train = _load(run_dir / METRICS_FILE, RunMetrics.load)
    if train is not None:
        metrics.update(_train_metrics(train))
    job = int(run_dir.name) if run_dir.name.isdigit() else -1
    return SweepRow(job=job, run_dir=run_dir, overrides=overrides, fits=fits, why=why, metrics=metrics)


def collect(sweep_dir: Path) -> list[SweepRow]:
    rows = [r for r in (read_run(p) for p in sorted(Path(sweep_dir).iterdir()) if p.is_dir()) if r is not None]
    return sorted(rows, key=lambda r: r.job)


def swept_keys(rows: list[SweepRow]) -> list[str]:
    """Override keys whose value differs between runs (all override keys when there is a single run)."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.overrides if k not in keys]
    if len(rows) <= 1:
        return keys
    return [k for k in keys if len({r.overrides.get(k) for r in rows}) > 1]


def _fmt(value: Optional[float]) -> str:
    """Readable number for the Markdown table."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _raw(value: Optional[float]) -> str:
    """Full-precision number for the CSV (machine-readable)."""
    return "" if value is None else repr(value)


def table(rows: list[SweepRow], fmt=_fmt) -> tuple[list[str], list[list[str]]]:
    keys = swept_keys(rows)
    header = ["job", *keys, "fits", "why", *METRIC_COLUMNS]
    body = [[str(r.job), *[r.overrides.get(k, "") for k in keys], "yes" if r.fits else "no", r.why,
             *[fmt(r.metrics.get(c)) for c in METRIC_COLUMNS]] for r in rows]
    return header, body


def write_csv(rows: list[SweepRow], path: Path) -> None:
    header, body = table(rows, fmt=_raw)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(body)


def write_markdown(rows: list[SweepRow], path: Path) -> None:
    header, body = table(rows)
    used = [i for i, name in enumerate(header)
            if name not in METRIC_COLUMNS or any(line[i] for line in body)]  # drop metric columns no run has
    esc = [[line[i].replace("|", "\\|") for i in used] for line in body]
    lines = ["| " + " | ".join(header[i] for i in used) + " |", "|" + "---|" * len(used)]
    lines += ["| " + " | ".join(line) + " |" for line in esc]
    path.write_text("\n".join(lines) + "\n")


def write_png(rows: list[SweepRow], path: Path, metric: str, x_key: Optional[str]) -> None:
    """metric against the swept value x_key (default: the first swept key), one line per other combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    x_key = x_key or (keys[0] if keys else None)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x_values: list[str] = []
    for r in rows:
        v = r.overrides.get(x_key, "") if x_key else str(r.job)
        if v not in x_values:
            x_values.append(v)
    others = [k for k in keys if k != x_key]
    groups: dict[str, list[SweepRow]] = {}
    for r in rows:
        groups.setdefault(", ".join(f"{k}={r.overrides.get(k, '')}" for k in others) or metric, []).append(r)
    for label, members in groups.items():
        xs = [x_values.index(r.overrides.get(x_key, "") if x_key else str(r.job)) for r in members]
        ys = [r.metrics.get(metric) if r.fits else None for r in members]
        ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], marker="o", label=label)
        bad = [x for x, y in zip(xs, ys) if y is None]
        if bad:
            ax.scatter(bad, [0.0] * len(bad), marker="x", color="red")
    ax.set_xticks(range(len(x_values)), x_values, rotation=20)
    ax.set_xlabel(x_key or "job")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by {x_key or 'job'} (red x: run did not fit / failed)")
    if len(groups) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(sweep_dir: Path, metric: str, x_key: Optional[str]) -> list[SweepRow]:
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    write_csv(rows, sweep_dir / "sweep_summary.csv")
    write_markdown(rows, sweep_dir / "sweep_summary.md")
    write_png(rows, sweep_dir / "sweep_summary.png", metric, x_key)
    return rows
