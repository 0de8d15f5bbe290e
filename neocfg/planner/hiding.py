"""What the bottom MLP hides of the pooled outputs' all-to-all under output_overlap, as the solvers carry it, so that
their objective is the plan's estimate and their bound holds for every plan of the enumerated options.

Where the plan overlaps (StepStrategies.output_overlap: the outputs' all-to-all sent before the bottom MLP, its
gradients' before the bottom MLP's backward), each device's step is shorter by, each way,
  h = min(efficiency x (latency x [some output comes back by all-to-all] + its pieces' all-to-all wire time),
          the bottom MLP's compute)
(efficiency is hardware.output_overlap_efficiency). The solvers plan with it where cfg's strategies will overlap on
any plan that has an all-to-all output (planned_output_overlap); a plan without one hides nothing (the indicator
above). The estimate (neocfg.planner.assemble) prices the same, Hiding.priced, where the plan's own strategies
overlap.

On a CPU device under train.output_overlap=auto the plan overlaps only where the bottom MLP covers the whole of it:
efficiency x (latency + wire) at most the bottom MLP's compute, each way, on every device (bottom_covers; the
strategies' rule). There a collective's copies run on the ranks' own cores: what the bottom MLP cannot cover runs
beside the embedding backward and DDP's all-reduce instead, and slowed a 856-table model's step by a fifth, while a
covered exchange (Criteo's) saved a tenth. A concrete plan then hides all of it or nothing (cover_only); the solvers'
rows keep the min() above, never less than what a plan hides, so their bound stays a bound, and pruning lets an
option dominate only where it adds no wire (it cannot uncover a plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from neocfg.config.model import TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.perf import Perf
from neocfg.planner.costs import CostModel, DenseCost, planned_dense_sync
from neocfg.planner.types import Placement, ShardingOption, Topology
from neocfg.sharding import SCHEMES, OutputKind
from neocfg.types import DenseGradSync, DeviceKind, OutputOverlap


def planned_output_overlap(cfg: NeocfgConfig) -> bool:
    """Whether a plan with an all-to-all output will overlap it with the bottom MLP, by the strategies' rule
    (neocfg.planner.strategies.output_overlap) with the dense sync priced before placement (planned_dense_sync)."""
    return cfg.train.output_overlap is not OutputOverlap.wait and planned_dense_sync(cfg) is DenseGradSync.ddp


@dataclass(frozen=True)
class Hiding:
    """The solvers' view of output_overlap: off (NO_HIDING) unless the plan overlaps and something can hide."""

    efficiency: float = 0.0
    latency_ms: float = 0.0      # one all-to-all's latency (each way)
    bottom: Perf = Perf()        # the bottom MLP's forward and backward compute: the most hidden each way
    cost: Optional[CostModel] = None
    tables: tuple[TableConfig, ...] = ()
    cover_only: bool = False     # a plan hides all (where the bottom MLP covers it on every device) or nothing
    _wire: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @staticmethod
    def of(cfg: NeocfgConfig, cost: CostModel, dense: DenseCost) -> "Hiding":
        if not planned_output_overlap(cfg):
            return NO_HIDING
        return Hiding.priced(cost, dense.bottom, cfg.model.tables, cover_only=auto_covers_only(cfg))

    @staticmethod
    def priced(cost: CostModel, bottom: Perf, tables: Sequence[TableConfig], cover_only: bool = False) -> "Hiding":
        """What overlapping hides at the cost model's efficiency, behind this bottom MLP, whatever cfg asks."""
        eff = cost.output_overlap_efficiency
        if eff <= 0 or bottom.compute <= 0:
            return NO_HIDING
        return Hiding(efficiency=eff, latency_ms=cost.collective_latency_ms, bottom=bottom, cost=cost,
                      tables=tuple(tables), cover_only=cover_only)

    @property
    def on(self) -> bool:
        return self.cost is not None

    def all_to_all(self, o: ShardingOption) -> bool:
        """The option's outputs come back by the world's all-to-all (as the planner places it)."""
        return self.cost is not None and self.cost.kind_of(o.sharding) is OutputKind.all_to_all

    def piece(self, o: ShardingOption) -> tuple[float, float]:
        """efficiency x (forward, backward) all-to-all wire time of one piece of the option."""
        if self.cost is None:
            return 0.0, 0.0
        key = (o.table_index, o.sharding, o.num_pieces)
        if key not in self._wire:
            table = self.tables[o.table_index]
            k = o.num_pieces if SCHEMES[o.sharding].sliced else 1
            fwd, bwd = self.cost.output_wire_ms(table, o.sharding, self.cost.shape(table, o.sharding, k))
            self._wire[key] = (self.efficiency * fwd, self.efficiency * bwd)
        return self._wire[key]

    @property
    def latency(self) -> float:
        """efficiency x one all-to-all's latency: what a device hides of it each way (every rank takes part)."""
        return self.efficiency * self.latency_ms

    def _capped(self, fwd, bwd):
        """What is hidden each way of efficiency x (latency + wire time) (wire already x efficiency: piece()), up to
        the bottom MLP's forward and backward compute: the one place the rule is written (floats or per-device
        arrays)."""
        return (np.minimum(self.latency + fwd, self.bottom.fwd_compute),
                np.minimum(self.latency + bwd, self.bottom.bwd_compute))

    def _device_wire(self, topo: Topology, placements: Sequence[Placement]) -> Optional[np.ndarray]:
        """[device, way] efficiency x the wire time of its pieces' output all-to-alls; None where no output comes
        back by all-to-all (then nothing is hidden, latency included)."""
        wire = np.zeros((topo.world, 2))
        a2a = False
        for p in placements:
            if not self.all_to_all(p.option):
                continue
            a2a = True
            f, b = self.piece(p.option)
            for r in p.ranks:
                wire[r, 0] += f
                wire[r, 1] += b
        return wire if a2a else None

    def covered(self, topo: Topology, placements: Sequence[Placement]) -> bool:
        """Whether some output of this plan comes back by all-to-all and the bottom MLP covers efficiency x (latency +
        wire) of it each way on every device (the strategies' auto rule on CPU devices; False with NO_HIDING)."""
        wire = self._device_wire(topo, placements)
        return wire is not None and self.covers(wire)

    def covers(self, wire: np.ndarray) -> bool:
        """Whether the bottom MLP covers efficiency x (latency + wire) each way on every device ([device, way])."""
        return bool(np.all(self.latency + wire[:, 0] <= self.bottom.fwd_compute)
                    and np.all(self.latency + wire[:, 1] <= self.bottom.bwd_compute))

    def _hiding_wire(self, topo: Topology, placements: Sequence[Placement]) -> Optional[np.ndarray]:
        """_device_wire where this plan hides anything (under cover_only: only where the bottom MLP covers it)."""
        wire = self._device_wire(topo, placements)
        return None if wire is None or (self.cover_only and not self.covers(wire)) else wire

    def per_device(self, topo: Topology, placements: Sequence[Placement]) -> list[Perf]:
        """Per device: what the bottom MLP hides of this plan's output all-to-all (fwd_comm) and of its gradients'
        (bwd_comm)."""
        wire = self._hiding_wire(topo, placements)
        if wire is None:
            return [Perf()] * topo.world
        fwd, bwd = self._capped(wire[:, 0], wire[:, 1])
        return [Perf(fwd_comm=float(f), bwd_comm=float(b)) for f, b in zip(fwd, bwd)]

    def device_hidden(self, topo: Topology, placements: Sequence[Placement]) -> np.ndarray:
        """Per device: what the bottom MLP hides of this plan's output all-to-alls (forward + backward)."""
        wire = self._hiding_wire(topo, placements)
        if wire is None:
            return np.zeros(topo.world)
        fwd, bwd = self._capped(wire[:, 0], wire[:, 1])
        return fwd + bwd

    def most(self, options: Sequence[Sequence[ShardingOption]]) -> float:
        """The most any device of any plan of these options hides: a device holds at most one piece of a table."""
        if self.cost is None or not any(self.all_to_all(o) for opts in options for o in opts):
            return 0.0
        fwd = sum(max((self.piece(o)[0] for o in opts if self.all_to_all(o)), default=0.0) for opts in options)
        bwd = sum(max((self.piece(o)[1] for o in opts if self.all_to_all(o)), default=0.0) for opts in options)
        return float(sum(self._capped(fwd, bwd)))

    def margin(self, a: ShardingOption, b: ShardingOption) -> float:
        """How much less a piece of `a` may let its device hide than a piece of `b` in its place (0: no less; under
        cover_only, infinite where `a` adds wire either way: it could uncover the plan, and every device lose what it
        hid)."""
        (af, ab), (bf, bb) = self.piece(a), self.piece(b)
        if self.cover_only and (af > bf or ab > bb):
            return math.inf
        return max(0.0, bf - af) + max(0.0, bb - ab)


NO_HIDING = Hiding()


def auto_covers_only(cfg: NeocfgConfig) -> bool:
    """train.output_overlap=auto on CPU devices: overlap only a plan whose exchange the bottom MLP covers."""
    return cfg.train.output_overlap is OutputOverlap.auto and cfg.hardware.device.kind is DeviceKind.cpu


def solver_overlaps(cfg: NeocfgConfig, cost: CostModel, hiding: Hiding, placements: Sequence[Placement]) -> bool:
    """Whether a plan of these placements overlaps its outputs' all-to-all in the solvers' view (`hiding`: Hiding.of
    cfg): the strategies' rule with the dense sync priced before placement (planned_output_overlap); under
    cover_only only where the bottom MLP covers it (as bottom_covers)."""
    if not planned_output_overlap(cfg):
        return False
    if not hiding.on:   # nothing can hide: overlapped wherever an output comes back by all-to-all, unless cover_only
        return not auto_covers_only(cfg) and any(cost.kind_of(p.option.sharding) is OutputKind.all_to_all
                                                 for p in placements)
    if hiding.cover_only:
        return hiding.covered(cost.topo, placements)
    return hiding._device_wire(cost.topo, placements) is not None


def bottom_covers(cfg: NeocfgConfig, plan) -> bool:
    """Whether the bottom MLP covers this plan's outputs' all-to-all each way on every device (module doc): the
    strategies' auto rule on CPU devices. False where nothing would hide (efficiency 0, no all-to-all output)."""
    from neocfg.planner.costs import dense_cost
    from neocfg.planner.estimate import placements_of   # (estimate -> assemble -> strategies -> here)

    cost = CostModel.from_config(cfg)
    hiding = Hiding.priced(cost, dense_cost(cfg, DenseGradSync.ddp).bottom, cfg.model.tables)
    return hiding.on and hiding.covered(cost.topo, placements_of(cfg, cost, plan))
