"""Why the plan is what it is: each table's choice set against the options it had, the critical device's estimate
term by term, the tables that cost most there, and what binds. mode=plan writes it as plan.md and prints its top
lines.

Every reason compares the chosen option with the table's other options, each put in the plan in its place (on the
least-loaded ranks) and priced by the cost model: the plan's embedding time summed over the devices ("costs less")
and on the busiest device, fixed costs included (the collectives of the sharding types used, each device's lookup
groups), and whether its pieces fit. In this order:
  constraint     the table's own settings (sharding_types, memory_tiers, weights_dtypes, ranks, column_slices) rule
                 out an option that costs less and would fit, or the settings leave it one option
  balance        an allowed option costs less and would fit, but raises the busiest device
  slack          an allowed option costs less, would fit and would not raise the busiest device: the table is off the
                 critical path and the step is the same either way
  memory         every allowed option that costs less does not fit: not on an empty device, or not where the plan
                 leaves room once this table is taken out
  communication  the allowed option that costs least; the next cheapest loses mostly on communication
  compute        the allowed option that costs least; the next cheapest loses mostly on lookups (compute)
What binds: memory when a table with a piece on the critical (busiest) device took a costlier option for memory; else
the critical device's larger part, compute (lookups, MLPs, the batch's generation) or network (all-to-alls, all-reduces).

For a plan rated as given (planner.plan_file) the reasons say what each choice costs against its
alternatives, not why it was made."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

import numpy as np

from neocfg.config.model import TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.perf import Perf
from neocfg.plan import GIVEN_PLAN_ALGORITHM, DeviceEstimate, Plan
from neocfg.planner.costs import GIB, CostModel
from neocfg.planner.estimate import placements_of
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.options import Choices, allowed_tiers, candidates, table_choices
from neocfg.planner.types import Placement, ShardingOption

# Relative tolerance when comparing two options' times (equal costs are not a reason to prefer one).
COST_RTOL = 1e-9
# Tables listed as costing most on the critical device (console and plan.md).
COSTLIEST = 5
# Lines of the per-table reasons printed on the console (plan.md has them all).
CONSOLE_TABLES = 5


class Reason(Enum):
    constraint = "constraint"
    memory = "memory"
    balance = "balance"
    slack = "slack"
    communication = "communication"
    compute = "compute"


class Binding(Enum):
    """What limits the step: memory (a faster option of some table does not fit), else the critical device's larger
    part, compute (lookups, MLPs, the batch's generation) or network (all-to-alls, all-reduces)."""

    memory = "memory"
    compute = "compute"
    network = "network"


@dataclass(frozen=True)
class TableChoice:
    name: str
    option: str                 # the chosen option's label (sharding[xk]/tier/dtype)
    ranks: tuple[int, ...]
    reason: Reason
    detail: str
    total_ms: float             # its time summed over the devices it touches
    critical_ms: float          # its time on the critical device (0 if it has no piece there)


@dataclass(frozen=True)
class CriticalTerms:
    """The critical (busiest) device's estimate: the four terms add up to its total_ms in plan.json."""

    rank: int
    embedding_compute_ms: float
    embedding_comm_ms: float
    dense_ms: float
    data_ms: float
    total_ms: float
    compute_ms: float           # embedding compute + dense compute + data
    network_ms: float           # embedding comm + dense comm
    fixed_ms: float             # the embedding part that no table's piece carries (lookup groups, collectives)


@dataclass(frozen=True)
class Explanation:
    terms: CriticalTerms
    binds: Binding
    binds_detail: str
    tables: tuple[TableChoice, ...]   # model order
    given: bool

    def costliest(self, n: int = COSTLIEST) -> list[TableChoice]:
        return sorted(self.tables, key=lambda t: (-t.critical_ms, -t.total_ms, t.name))[:n]


def _key(o: ShardingOption) -> tuple:
    return o.sharding, o.num_pieces, o.tier, o.dtype


def _unconstrained(cfg: NeocfgConfig, table: TableConfig) -> tuple[TableConfig, Choices]:
    free = dataclasses.replace(table, sharding_types=None, memory_tiers=None, weights_dtypes=None, ranks=None,
                               column_slices=None)
    return free, Choices(tuple(cfg.planner.sharding_types), allowed_tiers(cfg), tuple(cfg.planner.weights_dtypes))


def _constrained(table: TableConfig) -> bool:
    return any(getattr(table, k) is not None for k in ("sharding_types", "memory_tiers", "weights_dtypes", "ranks",
                                                       "column_slices"))


def _ms(x: float) -> str:
    return f"{x:,.3f} ms"


@dataclass(frozen=True)
class Swap:
    """The plan with one table's option replaced (placed on the least-loaded ranks, memory aside): its embedding
    time summed over the devices and on the busiest one, fixed costs included, and whether it has memory room."""

    option: ShardingOption
    compute_ms: float          # summed over the devices
    comm_ms: float
    busiest_ms: float
    fits_device: bool          # its piece fits an empty device
    fits_plan: bool            # the plan has room for its pieces once the table's own are taken out

    @property
    def sum_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    def say(self) -> str:
        o = self.option
        per = f", {_ms(o.perf.total)} on each of {o.num_pieces}" if o.num_pieces > 1 else ""
        return f"{o.label()} ({_ms(o.total_work)}{per})"


class _Plan:
    """The plan's embedding time per device as the cost model adds it up (pieces, then the fixed costs of the
    sharding types used and of each device's lookup groups: CostModel.embedding_overhead_ms), and memory loads."""

    def __init__(self, cost: CostModel, placements: Sequence[Placement]):
        self.cost = cost
        w = cost.topo.world
        self.loads = DeviceLoads.of(cost.topo, cost.capacity, placements, cost.rank_capacity)
        self.compute, self.comm = np.zeros(w), np.zeros(w)
        self.kinds: Counter = Counter()
        self.groups: dict[tuple, np.ndarray] = {}
        for p in placements:
            self._put(p.option, p.ranks, 1)
        self._fixed: dict[frozenset, tuple[Perf, Perf]] = {}

    def _put(self, o: ShardingOption, ranks: tuple[int, ...], sign: int) -> None:
        idx = np.fromiter(ranks, dtype=np.int64)
        self.compute[idx] += sign * o.perf.compute
        self.comm[idx] += sign * o.perf.comm
        self.kinds[o.sharding] += sign
        self.groups.setdefault((o.dtype, o.tier), np.zeros(self.cost.topo.world, dtype=np.int64))[idx] += sign

    def _overhead(self, kinds: frozenset) -> tuple[Perf, Perf]:
        """(fixed costs of a device without lookup groups, what each lookup group adds)."""
        if kinds not in self._fixed:
            base = self.cost.embedding_overhead_ms(kinds, 0)
            one = self.cost.embedding_overhead_ms(kinds, 1)
            self._fixed[kinds] = base, Perf(one.fwd_compute - base.fwd_compute, one.bwd_compute - base.bwd_compute,
                                            one.fwd_comm - base.fwd_comm, one.bwd_comm - base.bwd_comm)
        return self._fixed[kinds]

    def device_ms(self) -> tuple[np.ndarray, np.ndarray]:
        """(compute, comm) per device, fixed costs included."""
        base, per_group = self._overhead(frozenset(k for k, n in self.kinds.items() if n > 0))
        groups = sum((g > 0).astype(np.int64) for g in self.groups.values())
        return (self.compute + base.compute + groups * per_group.compute,
                self.comm + base.comm + groups * per_group.comm)

    def swap(self, own: Placement, o: ShardingOption) -> Swap:
        self.loads.add(own, -1)
        self._put(own.option, own.ranks, -1)
        try:
            fits_plan = self.loads.best_ranks(o) is not None
            ranks = self.loads.best_ranks(o, np.ones(self.cost.topo.world, dtype=bool))
            self._put(o, ranks, 1)
            compute, comm = self.device_ms()
            self._put(o, ranks, -1)
        finally:
            self._put(own.option, own.ranks, 1)
            self.loads.add(own, 1)
        return Swap(o, float(compute.sum()), float(comm.sum()), float((compute + comm).max()),
                    o.storage.fits(self.cost.most_capacity), fits_plan)

    def current(self, own: Placement) -> Swap:
        compute, comm = self.device_ms()
        return Swap(own.option, float(compute.sum()), float(comm.sum()), float((compute + comm).max()), True, True)


def _less(a: float, b: float) -> bool:
    return a < b - COST_RTOL * max(abs(b), 1.0)


def _reason(cfg: NeocfgConfig, cost: CostModel, state: _Plan, index: int, chosen: Placement) -> tuple[Reason, str]:
    """(reason, the facts behind it)."""
    table = cfg.model.tables[index]
    c = state.current(chosen)
    own = candidates(cfg, cost, index, table, table_choices(cfg, table))
    others = [state.swap(chosen, o) for o in own if _key(o) != _key(chosen.option)]
    if _constrained(table):
        free_table, free_ch = _unconstrained(cfg, table)
        own_keys = {_key(o) for o in own}
        ruled_out = [s for s in (state.swap(chosen, o) for o in candidates(cfg, cost, index, free_table, free_ch)
                                 if _key(o) not in own_keys)
                     if s.fits_device and s.fits_plan and _less(s.sum_ms, c.sum_ms)]
        if ruled_out:
            best = min(ruled_out, key=lambda s: s.sum_ms)
            return Reason.constraint, (f"its own settings rule out {best.say()}, which would fit and take"
                                       f" {_ms(c.sum_ms - best.sum_ms)} less summed over the devices")
    if not others:
        why = "its own settings" if _constrained(table) else "the planner's settings"
        return Reason.constraint, f"{why} leave it this one option"
    cheaper = sorted((s for s in others if _less(s.sum_ms, c.sum_ms)), key=lambda s: s.sum_ms)
    room = [s for s in cheaper if s.fits_device and s.fits_plan]
    if room:
        s = room[0]
        if _less(c.busiest_ms, s.busiest_ms):
            return Reason.balance, (f"{s.say()} takes {_ms(c.sum_ms - s.sum_ms)} less summed over the devices but"
                                    f" raises the busiest device's embedding time from {_ms(c.busiest_ms)} to"
                                    f" {_ms(s.busiest_ms)}")
        return Reason.slack, (f"{s.say()} takes {_ms(c.sum_ms - s.sum_ms)} less summed over the devices and would"
                              f" not raise the busiest device ({_ms(s.busiest_ms)}); the step is the same either way"
                              )
    if cheaper:
        s = cheaper[0]
        where = ("the plan has no room for it" if s.fits_device else
                 f"the largest device has {_gib(cost.most_capacity.hbm)} + {_gib(cost.most_capacity.host)} usable")
        return Reason.memory, (f"{s.say()} takes {_ms(c.sum_ms - s.sum_ms)} less summed over the devices but needs"
                               f" {_gib(s.option.storage.hbm)} device memory + {_gib(s.option.storage.host)} host"
                               f" per device; {where}")
    nxt = min(others, key=lambda s: s.sum_ms)
    d_comm, d_compute = nxt.comm_ms - c.comm_ms, nxt.compute_ms - c.compute_ms
    reason = Reason.communication if d_comm >= d_compute else Reason.compute
    return reason, (f"costs least of its {len(own)} options; next {nxt.say()}: communication {d_comm:+,.3f} ms,"
                    f" compute {d_compute:+,.3f} ms summed over the devices")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def critical_terms(plan: Plan, placements: Sequence[Placement]) -> CriticalTerms:
    d: DeviceEstimate = max(plan.devices, key=lambda x: (x.total_ms, -x.rank))
    e = plan.estimate
    emb_compute, emb_comm = d.compute_ms - e.dense_compute_ms, d.comm_ms - e.dense_comm_ms
    pieces = sum(p.option.perf.total for p in placements if d.rank in p.ranks)
    data = d.total_ms - d.compute_ms - d.comm_ms   # the device's share of the batch's generation (estimate.data_ms)
    data = 0.0 if abs(data) < 1e-9 else data       # not -0.000 where there is none
    return CriticalTerms(rank=d.rank, embedding_compute_ms=emb_compute, embedding_comm_ms=emb_comm,
                         dense_ms=e.dense_ms, data_ms=data, total_ms=d.total_ms,
                         compute_ms=d.compute_ms + data, network_ms=d.comm_ms,
                         fixed_ms=emb_compute + emb_comm - pieces)


def _fullest(loads: DeviceLoads) -> str:
    def share(used: np.ndarray, have: np.ndarray) -> np.ndarray:
        return np.where(have > 0, used / np.maximum(have, 1), 0.0)

    r = int(np.argmax(np.maximum(share(loads.hbm, loads.cap_hbm), share(loads.host, loads.cap_host))))
    return (f"the fullest, device {r}, holds {_gib(loads.hbm[r])} of {_gib(loads.cap_hbm[r])} usable device memory"
            f" and {_gib(loads.host[r])} of {_gib(loads.cap_host[r])} usable host DDR")


def explain(cfg: NeocfgConfig, plan: Plan, cost: Optional[CostModel] = None) -> Explanation:
    cost = cost if cost is not None else CostModel.from_config(cfg)
    placements = placements_of(cfg, cost, plan)
    state = _Plan(cost, placements)
    terms = critical_terms(plan, placements)
    choices = []
    for i, (t, p) in enumerate(zip(cfg.model.tables, placements)):
        reason, detail = _reason(cfg, cost, state, i, p)
        choices.append(TableChoice(name=t.name, option=p.option.label(), ranks=tuple(sorted(p.ranks)),
                                   reason=reason, detail=detail, total_ms=p.option.total_work,
                                   critical_ms=p.option.perf.total if terms.rank in p.ranks else 0.0))
    memory = [c for c in choices if c.reason is Reason.memory]
    critical = [c.name for c in memory if c.critical_ms > 0]
    if critical:
        binds = Binding.memory
        detail = (f"{len(critical)} table(s) on device {terms.rank} ({', '.join(critical[:3])}"
                  f"{' ...' if len(critical) > 3 else ''}) took a costlier option because a cheaper one does not"
                  f" fit; {_fullest(state.loads)}")
    else:
        binds = Binding.network if terms.network_ms > terms.compute_ms else Binding.compute
        limited = (f"{len(memory)} table(s) took a costlier option for memory, none on this device" if memory else
                   "no table's choice is limited by memory")
        detail = (f"device {terms.rank}: compute {_ms(terms.compute_ms)} (lookups, MLPs, data) vs network"
                  f" {_ms(terms.network_ms)}; {limited}")
    return Explanation(terms=terms, binds=binds, binds_detail=detail, tables=tuple(choices),
                       given=plan.solver.algorithm == GIVEN_PLAN_ALGORITHM)


def _ranks(ranks: tuple[int, ...]) -> str:
    """'0-7' for a run of consecutive ranks, else the list."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def terms_line(ex: Explanation) -> str:
    t = ex.terms
    return (f"critical device {t.rank}: {_ms(t.total_ms)} = embedding compute {_ms(t.embedding_compute_ms)}"
            f" + embedding comm {_ms(t.embedding_comm_ms)} + dense {_ms(t.dense_ms)} + data {_ms(t.data_ms)}")


def console_lines(ex: Explanation) -> list[str]:
    counts = {r: sum(1 for c in ex.tables if c.reason is r) for r in Reason}
    costly = ", ".join(f"{c.name} {_ms(c.critical_ms)} ({c.option}, {c.reason.value})" for c in ex.costliest()
                       if c.critical_ms > 0)
    return [terms_line(ex),
            f"binds: {ex.binds.value} ({ex.binds_detail})",
            f"costliest tables on device {ex.terms.rank}: {costly or 'none (no table has a piece there)'}",
            "why each table: " + ", ".join(f"{r.value} {n}" for r, n in counts.items() if n)]


def markdown(cfg: NeocfgConfig, plan: Plan, ex: Explanation) -> str:
    t = ex.terms
    given = ("\nThis plan was given (planner.plan_file) and rated, not solved: the reasons say what each choice costs"
             " against its alternatives, not why it was made.\n" if ex.given else "")
    lines = [f"# Plan of {plan.model_name} on {cfg.hardware.name}", given,
             f"{plan.world_size} devices ({plan.nodes} node(s) x {plan.devices_per_node}), batch"
             f" {plan.batch_size_per_device} per device; estimated step {_ms(plan.estimate.step_ms)}.", "",
             "## The critical device", "",
             "| term | ms |", "|---|---:|",
             f"| embedding compute | {t.embedding_compute_ms:.4f} |",
             f"| embedding comm | {t.embedding_comm_ms:.4f} |",
             f"| dense | {t.dense_ms:.4f} |",
             f"| data | {t.data_ms:.4f} |",
             f"| total (device {t.rank}) | {t.total_ms:.4f} |", "",
             f"Of the embedding part, {t.fixed_ms:.4f} ms is fixed per step (lookup groups, collectives' latency);"
             f" the rest is the tables' pieces on device {t.rank}.", "",
             f"**Binds: {ex.binds.value}.** {ex.binds_detail}.", "",
             "## The tables that cost most", "",
             f"| table | ms on device {t.rank} | ms on all devices | choice | reason |", "|---|---:|---:|---|---|"]
    lines += [f"| {c.name} | {c.critical_ms:.4f} | {c.total_ms:.4f} | {c.option} | {c.reason.value} |"
              for c in ex.costliest()]
    lines += ["", "## Every table", "",
              "| table | sharding | tier | dtype | ranks | reason | why |", "|---|---|---|---|---|---|---|"]
    for c in ex.tables:
        tp = plan.table(c.name)
        lines.append(f"| {c.name} | {tp.sharding.value} | {tp.memory.value} | {tp.weights_dtype.value} |"
                     f" {_ranks(c.ranks)} | {c.reason.value} | {c.detail} |")
    return "\n".join(lines) + "\n"
