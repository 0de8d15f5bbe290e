"""The flat, exact ILP for small instances: choose one option per table and put every piece on a device
(distinct devices for column slices, one node for table-row-wise / table-column-wise), per-device memory per tier,
minimize the busiest device's time (+ a tiny tie-breaker on total communication). A device's time is its pieces'
time plus the fixed costs (fixed.py): what every device pays (SharedFixed) and its lookup groups (a variable per
device and group, >= every table's pieces of that group on the device), less what the bottom MLP hides of the
outputs' all-to-all under output_overlap (hiding.py: a variable per device and direction). Symmetry breaking:
identical devices are sorted by their pieces' time within a node and symmetric nodes by their first device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.bounds import lower_bound
from neocfg.planner.fixed import GroupKey, lookup_group
from neocfg.planner.ilp_problem import IlpProblem, SharedFixed, run_model
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, Spread, Storage, Topology

Key = tuple[int, int]   # (table, option index)
# A run stopped on its time limit has stalled when it found its best plan within this share of the run: the rest went
# to proving, so a next run from that plan is unlikely to find a better one.
STALL_SHARE = 0.5


@dataclass
class FlatModel:
    p: IlpProblem
    prob: pulp.LpProblem = field(default_factory=lambda: pulp.LpProblem("neocfg_flat", pulp.LpMinimize))
    choose: list[list[pulp.LpVariable]] = field(default_factory=list)
    dev_vars: dict[Key, dict[int, pulp.LpVariable]] = field(default_factory=dict)
    node_vars: dict[Key, dict[int, pulp.LpVariable]] = field(default_factory=dict)
    terms: dict[str, list[list]] = field(default_factory=dict)
    # per device: (table, lookup group) -> the variables putting a piece of that table and group on the device
    group_terms: list[dict[tuple[int, GroupKey], list[pulp.LpVariable]]] = field(default_factory=list)
    groups: list[dict[GroupKey, pulp.LpVariable]] = field(default_factory=list)
    # per device: what the bottom MLP hides of the outputs' all-to-all forward and backward (hiding.py), and whether
    # any output comes back by all-to-all
    hidden: list[tuple[pulp.LpVariable, pulp.LpVariable]] = field(default_factory=list)
    a2a: Optional[pulp.LpVariable] = None

    def __post_init__(self) -> None:
        self.T = cbc.var(self.prob, "T", low=0)
        self.terms = {k: [[] for _ in range(self.p.topo.world)] for k in ("time", "hbm", "host", "wire_f", "wire_b")}
        self.group_terms = [{} for _ in range(self.p.topo.world)]
        for t, opts in enumerate(self.p.options):
            xs = [cbc.var(self.prob, f"x_{t}_{i}", cat="Binary") for i in range(len(opts))]
            self.choose.append(xs)
            self.prob += pulp.lpSum(xs) == 1, f"one_{t}"
            for i, o in enumerate(opts):
                self._add_option((t, i), o, xs[i])
        self.shared = SharedFixed.build(self.prob, self.p, self.choose, binary=True)
        self.F = self.shared.define(self.prob)   # the fixed time every device pays
        self._add_groups()
        self._add_hidden()
        self._add_device_rows()

    def _load(self, d: int, o: ShardingOption, var: pulp.LpVariable) -> None:
        self.terms["time"][d].append((var, o.perf.total))
        self.terms["hbm"][d].append((var, o.storage.hbm))
        self.terms["host"][d].append((var, o.storage.host))
        self.group_terms[d].setdefault((o.table_index, lookup_group(o)), []).append(var)
        if self.p.hiding.all_to_all(o):
            fwd, bwd = self.p.hiding.piece(o)
            self.terms["wire_f"][d].append((var, fwd))
            self.terms["wire_b"][d].append((var, bwd))

    def _add_hidden(self) -> None:
        """Under output_overlap (hiding.py), per device h_f <= efficiency x (latency x a2a + its pieces' forward wire)
        and h_f <= the bottom MLP's forward compute (h_b the same backward); a2a <= 1 only where some table chooses
        an option whose outputs come back by all-to-all. The device's time is less h_f + h_b."""
        hd = self.p.hiding
        if not hd.on:
            return
        prob = self.prob
        a2a_x = [x for t, opts in enumerate(self.p.options) for x, o in zip(self.choose[t], opts) if hd.all_to_all(o)]
        if not a2a_x:
            return
        self.a2a = cbc.var(prob, "a2a", cat="Binary")
        cbc.row(prob, [(self.a2a, 1.0)] + [(x, -1.0) for x in a2a_x], pulp.LpConstraintLE, 0.0, "a2a_used")
        for d in range(self.p.topo.world):
            pair = []
            for way, cap in (("f", hd.bottom.fwd_compute), ("b", hd.bottom.bwd_compute)):
                h = cbc.var(prob, f"h{way}_{d}", low=0)
                h.upBound = cap
                cbc.row(prob, [(h, 1.0), (self.a2a, -hd.latency)] + [(v, -c) for v, c in self.terms[f"wire_{way}"][d]],
                        pulp.LpConstraintLE, 0.0, f"h{way}_{d}")
                pair.append(h)
            self.hidden.append((pair[0], pair[1]))

    def _add_groups(self) -> None:
        """g[d][k] >= 1 when any table puts a piece of lookup group k on device d (a table puts at most one)."""
        self.groups = [{} for _ in range(self.p.topo.world)]
        if self.p.fixed.group_ms <= 0:
            return
        for d, per_table in enumerate(self.group_terms):
            for (t, k), vs in per_table.items():
                if k not in self.groups[d]:
                    self.groups[d][k] = cbc.var(self.prob, f"g_{d}_{k[0].value}_{k[1].value}", low=0)
                self.prob += self.groups[d][k] >= pulp.lpSum(vs), f"g_{d}_{t}_{k[0].value}_{k[1].value}"

    def _add_option(self, key: Key, o: ShardingOption, x: pulp.LpVariable) -> None:
        topo, prob, (t, i) = self.p.topo, self.prob, key
        if o.fixed_ranks is not None or o.spread is Spread.world:
            for d in (o.fixed_ranks if o.fixed_ranks is not None else range(topo.world)):
                self._load(d, o, x)
            return
        if o.spread in (Spread.node, Spread.node_distinct):
            ns = {n: cbc.var(prob, f"n_{t}_{i}_{n}", cat="Binary") for n in range(topo.nodes)}
            self.node_vars[key] = ns
            prob += pulp.lpSum(ns.values()) == x
            if o.spread is Spread.node:
                for d in range(topo.world):
                    self._load(d, o, ns[topo.node_of(d)])
                return
        zs = {d: cbc.var(prob, f"z_{t}_{i}_{d}", cat="Binary") for d in range(topo.world)}
        self.dev_vars[key] = zs
        prob += pulp.lpSum(zs.values()) == o.num_pieces * x
        for d, z in zs.items():
            if o.spread is Spread.node_distinct:
                prob += z <= self.node_vars[key][topo.node_of(d)]
            self._load(d, o, z)

    def _add_device_rows(self) -> None:
        p, prob, topo = self.p, self.prob, self.p.topo
        dev_time = [pulp.lpSum(c * v for v, c in self.terms["time"][d]) for d in range(topo.world)]
        known = max(lower_bound(topo, p.options, p.fixed, p.hiding), p.known_bound_ms)
        prob += self.T >= p.offset_ms + known, "known_bound"
        for d in range(topo.world):
            groups = pulp.lpSum(p.fixed.group_ms * g for g in self.groups[d].values())
            hidden = pulp.lpSum(self.hidden[d]) if self.hidden else 0
            prob += dev_time[d] + groups + self.F + p.offset_ms - hidden <= self.T, f"time_{d}"
            cap = p.capacity_of(d)
            for tier, limit in (("hbm", cap.hbm), ("host", cap.host)):
                prob += _memory_row(self.terms[tier][d], limit), f"{tier}_{d}"
        pinned = p.pinned
        free = [d for d in range(topo.world) if d not in pinned]
        for a, b in zip(free, free[1:]):
            if topo.node_of(a) == topo.node_of(b):
                prob += dev_time[a] >= dev_time[b], f"sym_{a}"
        if not pinned:
            pn = topo.devices_per_node
            for n in range(topo.nodes - 1):
                prob += dev_time[n * pn] >= dev_time[(n + 1) * pn], f"symnode_{n}"

    def set_objective(self, weight: float) -> None:
        comm = pulp.lpSum(o.total_comm * self.choose[t][i]
                          for t, opts in enumerate(self.p.options) for i, o in enumerate(opts))
        self.prob += self.T + weight * comm

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None:
        for t, pl in enumerate(warm):
            chosen = next(j for j, o in enumerate(self.p.options[t]) if o is pl.option)
            for j, x in enumerate(self.choose[t]):
                x.setInitialValue(1.0 if j == chosen else 0.0)
                for d, z in self.dev_vars.get((t, j), {}).items():
                    z.setInitialValue(1.0 if j == chosen and d in pl.ranks else 0.0)
                node = self.p.topo.node_of(pl.ranks[0])
                for n, v in self.node_vars.get((t, j), {}).items():
                    v.setInitialValue(1.0 if j == chosen and n == node else 0.0)
        self.shared.warm_start(pl.option for pl in warm)
        self.F.setInitialValue(self.p.fixed.shared_ms({pl.option.sharding for pl in warm}))
        held: list[set[GroupKey]] = [set() for _ in range(self.p.topo.world)]
        for pl in warm:
            for r in pl.ranks:
                held[r].add(lookup_group(pl.option))
        for d, gs in enumerate(self.groups):
            for k, g in gs.items():
                g.setInitialValue(1.0 if k in held[d] else 0.0)
        if self.a2a is not None:
            hd, a2a = self.p.hiding, any(self.p.hiding.all_to_all(pl.option) for pl in warm)
            self.a2a.setInitialValue(1.0 if a2a else 0.0)
            wire = [[0.0, 0.0] for _ in range(self.p.topo.world)]
            for pl in warm:
                if hd.all_to_all(pl.option):
                    for r in pl.ranks:
                        wire[r] = [w + c for w, c in zip(wire[r], hd.piece(pl.option))]
            for d, (hf, hb) in enumerate(self.hidden):
                lat = hd.latency if a2a else 0.0
                hf.setInitialValue(min(lat + wire[d][0], hd.bottom.fwd_compute))
                hb.setInitialValue(min(lat + wire[d][1], hd.bottom.bwd_compute))
        self.T.setInitialValue(upper)

    def placements(self) -> list[Placement]:
        out = []
        for t, opts in enumerate(self.p.options):
            i = max(range(len(opts)), key=lambda j: self.choose[t][j].value() or 0.0)
            out.append(self._placement((t, i), opts[i]))
        return out

    def _placement(self, key: Key, o: ShardingOption) -> Placement:
        topo = self.p.topo
        if o.fixed_ranks is not None:
            return Placement(o, o.fixed_ranks)
        if o.spread is Spread.world:
            return Placement(o, tuple(range(topo.world)))
        if o.spread is Spread.node:
            node = max(self.node_vars[key].items(), key=lambda kv: kv[1].value() or 0.0)[0]
            return Placement(o, topo.node_ranks(node))
        zs = self.dev_vars[key]
        ranks = sorted(zs, key=lambda d: -(zs[d].value() or 0.0))[:o.num_pieces]
        return Placement(o, tuple(sorted(ranks)))


def _memory_row(terms: Sequence[tuple[pulp.LpVariable, float]], capacity: int) -> pulp.LpConstraint:
    """A device's bytes of one tier <= its capacity, written as shares of the capacity: rows of bytes (~1e10) beside
    the time rows (~1e-4 ms, tie-breaker coefficients ~1e-11) are scaled so badly that CBC proved bounds above a
    feasible plan's objective (the TorchRec drop-in on DCNv2 x 8: bound 0.7444 ms, plan 0.7416 ms). A tier of
    capacity 0 keeps its bytes (<= 0: no piece that uses it)."""
    if capacity > 0:
        return pulp.lpSum(c / capacity * v for v, c in terms) <= 1
    return pulp.lpSum(c * v for v, c in terms) <= 0


def canonical(topo: Topology, capacity: Storage, placements: Sequence[Placement],
              pinned: set[int]) -> list[Placement]:
    """The same plan with devices renumbered as the symmetry-breaking constraints want: free devices sorted by load
    within their node; without pinned devices also nodes sorted by their busiest device."""
    time_ = DeviceLoads.of(topo, capacity, placements).time
    pn = topo.devices_per_node
    nodes = list(range(topo.nodes))
    if not pinned:
        nodes.sort(key=lambda n: -max(time_[r] for r in topo.node_ranks(n)))
    new_rank = {}
    for new_node, old_node in enumerate(nodes):
        ranks = topo.node_ranks(old_node)
        free_old = sorted((r for r in ranks if r not in pinned), key=lambda r: -time_[r])
        free_new = [new_node * pn + (r - old_node * pn) for r in ranks if r not in pinned]
        new_rank.update(zip(free_old, free_new))
        new_rank.update({r: r for r in ranks if r in pinned})
    out = []
    for pl in placements:
        ranks = tuple(new_rank[r] for r in pl.ranks)
        if pl.option.spread in (Spread.world, Spread.node):
            ranks = tuple(sorted(ranks))
        out.append(Placement(pl.option, ranks))
    return out


def solve_flat(p: IlpProblem, warm: Optional[Sequence[Placement]]) -> tuple[Optional[list[Placement]], float, str]:
    """Returns (placements or None, proven lower bound on the busiest device's embedding time, status): the solver's
    status, "stalled" where it stopped on its time limit with its best plan found early in the run (STALL_SHARE)."""
    model = FlatModel(p)
    out, weight = run_model(p, model, canonical(p.topo, p.capacity, warm, p.pinned) if warm else None)
    if out.objective is None:
        if out.status == "infeasible":
            return None, float("inf"), "infeasible"
        return None, p.bound_on_makespan(out.bound, weight), out.status
    stalled = out.status == "feasible" and out.found_s is not None and out.found_s < STALL_SHARE * out.seconds
    return model.placements(), p.bound_on_makespan(out.bound, weight), "stalled" if stalled else out.status
