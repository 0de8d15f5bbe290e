"""The aggregated option-choice ILP of the decomposition (large instances).

Devices are identical and nodes symmetric, so which device gets which piece is left to the placement stage; the
model only chooses one option per table, subject to what every plan must satisfy:
  average      T >= U + sum of placed work / W                 (U: time of uniform row-wise/data-parallel options)
  piece        T >= U + the piece time of each table's option
  memory       total memory per tier <= W x capacity; U's memory + any one piece <= capacity
  piece count  more than (k-1) x W pieces put k pieces of distinct tables on some device (y_k), which weigh at
               least the k smallest per-table piece times, and (threshold cuts) k x lam - sum max(0, lam - piece)
  fixed        every device pays F (SharedFixed: base, each collective group used), and the device
               busiest with pieces at least one lookup group: both are added to every time bound above
  hidden       under output_overlap, what the bottom MLP hides of the outputs' all-to-all (hiding.py) is taken
               off: the most one device can hide, or in the average row the most the devices hide on average
Every feasible plan satisfies these, so the model's optimum, the solver's proven bound on it and the optimum of its
LP relaxation bound every plan from below (at full capacity)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulp

from neocfg.planner import cbc
from neocfg.planner.ilp_problem import IlpProblem, SharedFixed
from neocfg.planner.types import Placement, ShardingOption, Storage

# Piece-count levels modelled (more only tighten a bound the average already gives).
MAX_PIECE_LEVELS = 32
# Budget of constraint nonzeros for the threshold cuts (keeps the model small for large instances).
THRESHOLD_NONZEROS = 200_000


GE, LE, EQ = pulp.LpConstraintGE, pulp.LpConstraintLE, pulp.LpConstraintEQ


def _share(nbytes: int, capacity: int) -> float:
    """Bytes as a share of a device's capacity (the memory rows in these units keep the model well scaled; options
    only exist for a tier of capacity 0 when they use none of it)."""
    return nbytes / capacity if capacity > 0 else 0.0


@dataclass
class AggregateModel:
    """Rows are built from (variable, coefficient) lists in one go (cbc.row): prod_4096 x 512 has ~10^5 columns and
    ~10^6 nonzeros. Memory rows are in shares of a device's capacity."""

    p: IlpProblem
    capacity: Storage
    prob: pulp.LpProblem = field(default_factory=lambda: pulp.LpProblem("neocfg_aggregate", pulp.LpMinimize))
    xs: list[list[pulp.LpVariable]] = field(default_factory=list)
    levels: list[tuple[int, pulp.LpVariable]] = field(default_factory=list)
    # the memory rows and their right-hand sides at full capacity: set_headroom scales them
    memory_rows: list[tuple[pulp.LpConstraint, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        prob, p, cap, w = self.prob, self.p, self.capacity, self.p.topo.world
        row = cbc.row
        self.T = cbc.var(prob, "T", low=0)
        self.U = cbc.var(prob, "U", low=0)      # time every device spends on uniform (RW/DP) pieces
        self.Uh = cbc.var(prob, "Uh", low=0)    # their HBM on every device (share of its capacity)
        self.Us = cbc.var(prob, "Us", low=0)    # their host memory on every device (share)
        self.xs = [[cbc.var(prob, f"x_{t}_{i}", cat="Binary") for i in range(len(opts))]
                   for t, opts in enumerate(p.options)]
        self.pairs = [(x, o) for t, opts in enumerate(p.options) for x, o in zip(self.xs[t], opts)]
        self.shared = SharedFixed.build(prob, p, self.xs, binary=False)
        self.F = self.shared.define(prob)       # the fixed time every device pays
        self._add_hidden()
        hbm = {id(o): _share(o.storage.hbm, cap.hbm) for _, o in self.pairs}
        host = {id(o): _share(o.storage.host, cap.host) for _, o in self.pairs}
        uniform = [(x, o) for x, o in self.pairs if o.is_uniform]
        for t, xs in enumerate(self.xs):
            row(prob, [(x, 1.0) for x in xs], EQ, 1.0, f"one_{t}")
        row(prob, [(self.U, 1.0)] + [(x, -o.perf.total) for x, o in uniform], EQ, 0.0, "uniform_time")
        row(prob, [(self.Uh, 1.0)] + [(x, -hbm[id(o)]) for x, o in uniform], EQ, 0.0, "uniform_hbm")
        row(prob, [(self.Us, 1.0)] + [(x, -host[id(o)]) for x, o in uniform], EQ, 0.0, "uniform_host")
        row(prob, self._base_terms(average=True) + [(x, -o.total_work / w) for x, o in self.placed], GE, self.base_ms,
            "average")
        self._memory_row([(x, hbm[id(o)] * o.num_pieces) for x, o in self.pairs], float(w), "hbm_total")
        self._memory_row([(x, host[id(o)] * o.num_pieces) for x, o in self.pairs], float(w), "host_total")
        self._memory_row([(self.Uh, 1.0)], 1.0, "uniform_hbm_fits")
        self._memory_row([(self.Us, 1.0)], 1.0, "uniform_host_fits")
        for t, opts in enumerate(p.options):
            mine = [(x, o) for x, o in zip(self.xs[t], opts) if not o.is_uniform]
            if not mine:
                continue
            row(prob, self._base_terms() + [(x, -o.perf.total) for x, o in mine], GE, self.base_ms, f"piece_{t}")
            self._memory_row([(self.Uh, 1.0)] + [(x, hbm[id(o)]) for x, o in mine], 1.0, f"piece_hbm_{t}")
            self._memory_row([(self.Us, 1.0)] + [(x, host[id(o)]) for x, o in mine], 1.0, f"piece_host_{t}")
        self._add_piece_levels()

    def _memory_row(self, terms: list[tuple[pulp.LpVariable, float]], rhs: float, name: str) -> None:
        self.memory_rows.append((cbc.row(self.prob, terms, LE, rhs, name), rhs))

    def set_headroom(self, scale: float, share: float) -> None:
        """Use only `scale` of every device's memory, and leave out options whose piece needs more than `share` of
        it (each table keeps its smallest): what placing the choice needs when the model's total-memory rows let it
        fill the devices so full that the pieces no longer pack. (1, 1): the model as built, whose optimum bounds
        every plan."""
        for constraint, rhs in self.memory_rows:
            constraint.changeRHS(rhs * scale)
        for t, opts in enumerate(self.p.options):
            fraction = [self._fraction(o) for o in opts]
            smallest = min(range(len(opts)), key=fraction.__getitem__)
            for j, x in enumerate(self.xs[t]):
                x.upBound = 1 if fraction[j] <= share or j == smallest else 0

    def _fraction(self, o: ShardingOption) -> float:
        """The largest share of a device's memory (of either tier) one piece of the option needs."""
        return max(_share(o.storage.hbm, self.capacity.hbm), _share(o.storage.host, self.capacity.host))

    def fill(self, chosen: Sequence[ShardingOption]) -> float:
        """The largest share of all devices' memory (of either tier) these options' pieces take together."""
        w = self.p.topo.world
        return max(sum(_share(o.storage.hbm, self.capacity.hbm) * o.num_pieces for o in chosen) / w,
                   sum(_share(o.storage.host, self.capacity.host) * o.num_pieces for o in chosen) / w)

    @property
    def base_ms(self) -> float:
        """The constant part of the time on the busiest device besides its placed pieces: the dense part and one
        lookup group (the device busiest with pieces holds one)."""
        return self.p.offset_ms + (self.p.fixed.group_ms if self.p.options else 0.0)

    def _base_terms(self, average: bool = False) -> list[tuple[pulp.LpVariable, float]]:
        """T - U - F (+ H): T >= U + F + base_ms + the placed pieces' time (- what the bottom MLP hides on a device,
        H) is T - U - F - pieces + H >= base_ms. H: the most one device hides, or in the average row the most the
        devices hide on average."""
        hidden = [(h, 1.0) for h in (self.hidden_avg if average else self.hidden_most)]
        return [(self.T, 1.0), (self.U, -1.0), (self.F, -1.0)] + hidden

    def _add_hidden(self) -> None:
        """Under output_overlap (hiding.py) a device hides at most min(efficiency x (latency x a2a + its pieces'
        wire), the bottom MLP's compute) each way, where a2a <= 1 only if some table's outputs come back by
        all-to-all. A device holds at most one piece of a table, so no device hides more than with every chosen
        option's piece (hidden_most); the devices hide on average at most that with the chosen pieces' wire spread
        over the world (hidden_avg: the mean of a minimum is at most the minimum of the means)."""
        self.hidden_most: list[pulp.LpVariable] = []
        self.hidden_avg: list[pulp.LpVariable] = []
        self.a2a = None
        hd, prob, w = self.p.hiding, self.prob, self.p.topo.world
        if not hd.on:
            return
        mine = [(x, o) for x, o in self.pairs if hd.all_to_all(o)]
        if not mine:
            return
        self.a2a = cbc.var(prob, "a2a", low=0)
        self.a2a.upBound = 1
        cbc.row(prob, [(self.a2a, 1.0)] + [(x, -1.0) for x, _ in mine], LE, 0.0, "a2a_used")
        for way, cap in ((0, hd.bottom.fwd_compute), (1, hd.bottom.bwd_compute)):
            for name, share, out in (("most", lambda o: 1.0, self.hidden_most),
                                     ("avg", lambda o: o.num_pieces / w, self.hidden_avg)):
                h = cbc.var(prob, f"h_{name}_{way}", low=0)
                h.upBound = cap
                wire = [(x, -hd.piece(o)[way] * share(o)) for x, o in mine]
                cbc.row(prob, [(h, 1.0), (self.a2a, -hd.latency)] + wire, LE, 0.0, f"h_{name}_{way}")
                out.append(h)

    @property
    def placed(self) -> list[tuple[pulp.LpVariable, ShardingOption]]:
        return [(x, o) for x, o in self.pairs if not o.is_uniform]

    def _add_piece_levels(self) -> None:
        w, prob, row = self.p.topo.world, self.prob, cbc.row
        inf = float("inf")
        q = sorted(min((o.perf.total for o in opts if not o.is_uniform), default=inf) for opts in self.p.options)
        q = [x for x in q if x != inf]
        most = sum(max((o.num_pieces for o in opts if not o.is_uniform), default=0) for opts in self.p.options)
        count = cbc.var(prob, "pieces", low=0)   # pieces placed (one variable: each level row names it once)
        row(prob, [(count, 1.0)] + [(x, -float(o.num_pieces)) for x, o in self.placed], EQ, 0.0, "pieces")
        for k in range(1, min(len(q), MAX_PIECE_LEVELS) + 1):
            if most <= (k - 1) * w:
                break
            y = cbc.var(prob, f"y_{k}", cat="Binary")
            row(prob, [(count, 1.0), (y, -float(most - (k - 1) * w))], LE, float((k - 1) * w), f"level_{k}")
            if self.levels:
                row(prob, [(self.levels[-1][1], 1.0), (y, -1.0)], GE, 0.0, f"level_order_{k}")
            self.levels.append((k, y))
        self.count = count
        if self.levels:
            row(prob, self._base_terms() + [(y, -q[k - 1]) for k, y in self.levels], GE, self.base_ms,
                "piece_levels")
            self._add_threshold_cuts()

    def _add_threshold_cuts(self) -> None:
        placed = self.placed
        values = sorted({round(o.perf.total, 12) for _, o in placed})
        per_level = max(0, min(len(values), THRESHOLD_NONZEROS // (len(placed) * len(self.levels))))
        if per_level == 0:
            return
        lams = sorted({values[min(len(values) - 1, (j * len(values)) // per_level)] for j in range(per_level)})
        for k, y in self.levels:
            for j, lam in enumerate(lams):
                slack = [(x, lam - o.perf.total) for x, o in placed if o.perf.total < lam]
                cbc.row(self.prob, self._base_terms() + [(y, -k * lam)] + slack, GE, self.base_ms,
                        f"threshold_{k}_{j}")

    def set_objective(self, weight: float) -> None:
        # assigned (the LP relaxation and then the MIP set it on one model; += would warn the second time)
        self.prob.objective = pulp.LpAffineExpression([(self.T, 1.0)]
                                                      + [(x, weight * o.total_comm) for x, o in self.pairs])

    def warm_start(self, warm: Sequence[Placement], upper: float) -> None:
        chosen = {id(pl.option) for pl in warm}
        for x, o in self.pairs:
            x.setInitialValue(1.0 if id(o) in chosen else 0.0)
        picked = [o for _, o in self.pairs if id(o) in chosen]
        cap = self.capacity
        self.U.setInitialValue(sum(o.perf.total for o in picked if o.is_uniform))
        self.Uh.setInitialValue(sum(_share(o.storage.hbm, cap.hbm) for o in picked if o.is_uniform))
        self.Us.setInitialValue(sum(_share(o.storage.host, cap.host) for o in picked if o.is_uniform))
        self.shared.warm_start(picked)
        self.F.setInitialValue(self.p.fixed.shared_ms({o.sharding for o in picked}))
        if self.a2a is not None:
            hd, w = self.p.hiding, self.p.topo.world
            mine = [o for o in picked if hd.all_to_all(o)]
            lat = hd.latency if mine else 0.0
            self.a2a.setInitialValue(1.0 if mine else 0.0)
            for way, cap in ((0, hd.bottom.fwd_compute), (1, hd.bottom.bwd_compute)):
                self.hidden_most[way].setInitialValue(min(cap, lat + sum(hd.piece(o)[way] for o in mine)))
                self.hidden_avg[way].setInitialValue(
                    min(cap, lat + sum(hd.piece(o)[way] * o.num_pieces / w for o in mine)))
        self.T.setInitialValue(upper)
        pieces = sum(o.num_pieces for o in picked if not o.is_uniform)
        for k, y in self.levels:
            y.setInitialValue(1.0 if pieces > (k - 1) * self.p.topo.world else 0.0)
        self.count.setInitialValue(pieces)

    def picked(self) -> list[ShardingOption]:
        """Each table's option with the largest value (the LP relaxation's solution rounded; a MIP's as it is)."""
        return [opts[max(range(len(opts)), key=lambda j: self.xs[t][j].value() or 0.0)]
                for t, opts in enumerate(self.p.options)]
