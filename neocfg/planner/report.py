"""The printed summary of a plan and plan.png (per-device time and memory bars, matplotlib Agg)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from neocfg.config.schema import NeocfgConfig
from neocfg.plan import GIVEN_PLAN_ALGORITHM, DeviceEstimate, Plan
from neocfg.sharding import SCHEMES
from neocfg.types import ShardingType
from neocfg.units import fmt_bytes

GIB = 1024**3
# With more devices than this the table lists the busiest and the least busy ones only.
MAX_LISTED_DEVICES = 16


@dataclass(frozen=True)
class Capacities:
    """Physical memory per device, for percentages: HBM (a CPU rank's memory) and its share of host DDR."""

    hbm: float
    host: float

    @staticmethod
    def of(cfg: NeocfgConfig) -> "Capacities":
        hw = cfg.hardware
        return Capacities(hbm=hw.device.hbm_gib * GIB, host=hw.host.ddr_gib * GIB / hw.devices_per_node)


def _pct(used: float, cap: float) -> str:
    return f"{100 * used / cap:5.1f}%" if cap > 0 else "   - "


def _device_row(d: DeviceEstimate, caps: Capacities) -> str:
    counts = " ".join(f"{SCHEMES[s].abbrev}={d.shard_counts[s.value]}" for s in ShardingType
                      if d.shard_counts.get(s.value))
    return (f"  {d.rank:>5} {d.hbm_bytes / GIB:>9.2f} {_pct(d.hbm_bytes, caps.hbm)} {d.host_bytes / GIB:>9.2f}"
            f" {_pct(d.host_bytes, caps.host)} {d.compute_ms:>10.3f} {d.comm_ms:>8.3f} {d.total_ms:>9.3f}  {counts}")


def _listed(plan: Plan) -> tuple[list[DeviceEstimate], int]:
    devs = list(plan.devices)
    if len(devs) <= MAX_LISTED_DEVICES:
        return devs, 0
    by_time = sorted(devs, key=lambda d: -d.total_ms)
    shown = by_time[:MAX_LISTED_DEVICES * 3 // 4] + by_time[-MAX_LISTED_DEVICES // 4:]
    return shown, len(devs) - len(shown)


def collective_lines(plan: Plan) -> list[str]:
    """One line per collective of a step (Plan.collectives, in the order a step issues them): calls per step, the
    group, what it carries, the most bytes any rank sends in it, and whether it overlaps compute."""
    if not plan.collectives:
        return []
    order: list = []
    most: dict = {}
    for rank in plan.collectives:
        for c in rank:
            if c.key not in most:
                order.append(c)
            most[c.key] = max(most.get(c.key, 0.0), c.sent)
    lines = [f"collectives per step ({len(order)}; bytes: the most a rank sends):"]
    lines += [f"  {c.count} x {c.kind.value} over {c.group.value.replace('_', ' ')}: {c.carries.value.replace('_', ' ')},"
              f" {fmt_bytes(most[c.key])}, {'overlapped' if c.overlapped else 'exposed'}" for c in order]
    return lines


def summary(cfg: NeocfgConfig, plan: Plan) -> str:
    hw = cfg.hardware
    caps = Capacities.of(cfg)
    s, e = plan.solver, plan.estimate
    lines = [f"plan {plan.model_name} on {hw.name}: {plan.world_size} devices ({plan.nodes} node(s) x"
             f" {plan.devices_per_node}), batch {plan.batch_size_per_device} per device,"
             f" all-to-all {plan.a2a_fwd_dtype.value}/{plan.a2a_bwd_dtype.value} (fwd/bwd)",
             f"  {'rank':>5} {'HBM GiB':>9} {'HBM%':>6} {'host GiB':>9} {'host%':>6} {'compute ms':>10}"
             f" {'comm ms':>8} {'total ms':>9}  shards"]
    shown, hidden = _listed(plan)
    if hidden:
        lines[-1] += "   (busiest first)"
    lines += [_device_row(d, caps) for d in shown]
    if hidden:
        lines.insert(2 + MAX_LISTED_DEVICES * 3 // 4, f"  ... {hidden} more devices ...")
    hbm = sum(d.hbm_bytes for d in plan.devices)
    host = sum(d.host_bytes for d in plan.devices)
    per_type = Counter(t.sharding for t in plan.tables)
    per_tier = Counter(t.memory.value for t in plan.tables)
    per_dtype = Counter(t.weights_dtype.value for t in plan.tables)
    w = plan.world_size
    lines += [
        f"totals: HBM {hbm / GIB:,.2f} GiB ({_pct(hbm, caps.hbm * w).strip()}), host {host / GIB:,.2f} GiB"
        f" ({_pct(host, caps.host * w).strip()}); tables: "
        + ", ".join(f"{SCHEMES[k].abbrev} {v}" for k, v in sorted(per_type.items(), key=lambda kv: -kv[1]))
        + "; tiers: " + ", ".join(f"{k} {v}" for k, v in sorted(per_tier.items()))
        + "; weights: " + ", ".join(f"{k} {v}" for k, v in sorted(per_dtype.items())),
        f"estimate: step {e.step_ms:,.3f} ms (dense {e.dense_ms:,.3f} ms), {e.samples_per_s:,.0f} samples/s",
        f"step: {plan.strategies.describe() if plan.strategies else 'strategies not resolved'}",
        *collective_lines(plan),
        (f"solver {s.algorithm}: {s.status}; rated in {s.seconds:.2f} s" if s.algorithm == GIVEN_PLAN_ALGORITHM else
         f"solver {s.algorithm}: {s.status}; objective {s.objective_ms:,.4f} ms, lower bound"
         f" {s.lower_bound_ms:,.4f} ms (over every plan of the enumerated options), gap {100 * s.gap:.2f}%,"
         f" {s.seconds:.2f} s; placement from {s.placement_source}"),
    ]
    if plan.dpp is not None:
        d = plan.dpp
        shapes = ", ".join(f"{v} x {k}" for k, v in d.workers_by_shape.items())
        plural = "" if d.workers == 1 else "s"
        lines.append(f"DPP: {d.workers} worker{plural} ({shapes}), {d.workers_per_trainer_node:.2f} per trainer node;"
                     f" bottleneck {d.bottleneck}; demand {d.demand_samples_per_s:,.0f} samples/s, capacity"
                     f" {d.capacity_samples_per_s:,.0f} samples/s (headroom {100 * cfg.dsi.headroom:.0f}%)")
    return "\n".join(lines)


def save_png(cfg: NeocfgConfig, plan: Plan, path: Path) -> None:
    """Per-device bars: compute and communication ms (stacked), and HBM / host GiB against capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = Capacities.of(cfg)
    ranks = [d.rank for d in plan.devices]
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(8.0, min(24.0, 0.12 * len(ranks) + 6)), 7), sharex=True)
    comp = [d.compute_ms for d in plan.devices]
    comm = [d.comm_ms for d in plan.devices]
    ax_t.bar(ranks, comp, label="compute", color="#4c72b0")
    ax_t.bar(ranks, comm, bottom=comp, label="communication", color="#dd8452")
    if plan.solver.algorithm != GIVEN_PLAN_ALGORITHM:
        ax_t.axhline(plan.solver.lower_bound_ms, color="k", ls="--", lw=1, label="lower bound")
    ax_t.set_ylabel("ms per step")
    gap = "" if plan.solver.algorithm == GIVEN_PLAN_ALGORITHM else f" gap {100 * plan.solver.gap:.2f}%"
    ax_t.set_title(f"{plan.model_name} on {cfg.hardware.name}: step {plan.estimate.step_ms:.3f} ms,{gap}"
                   f" ({plan.solver.algorithm})")
    ax_t.legend(loc="upper right", fontsize=8)
    width = 0.4
    ax_m.bar([r - width / 2 for r in ranks], [100 * d.hbm_bytes / caps.hbm for d in plan.devices], width,
             label=f"HBM (of {caps.hbm / GIB:,.0f} GiB)", color="#55a868")
    ax_m.bar([r + width / 2 for r in ranks], [100 * d.host_bytes / caps.host for d in plan.devices], width,
             label=f"host DDR (of a {caps.host / GIB:,.0f} GiB share)", color="#8172b3")
    ax_m.axhline(100, color="k", ls="--", lw=1)
    ax_m.set_ylim(0, 110)
    ax_m.set_ylabel("memory used, % per device")
    ax_m.set_xlabel("rank")
    ax_m.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
