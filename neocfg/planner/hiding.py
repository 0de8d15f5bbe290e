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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from neocfg.config.model import TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.perf import Perf
from neocfg.planner.costs import CostModel, DenseCost, planned_dense_sync
from neocfg.planner.types import Placement, ShardingOption, Topology
from neocfg.sharding import SCHEMES, OutputKind
from neocfg.types import DenseGradSync, OutputOverlap


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
    _wire: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @staticmethod
    def of(cfg: NeocfgConfig, cost: CostModel, dense: DenseCost) -> "Hiding":
        return Hiding.priced(cost, dense.bottom, cfg.model.tables) if planned_output_overlap(cfg) else NO_HIDING

    @staticmethod
    def priced(cost: CostModel, bottom: Perf, tables: Sequence[TableConfig]) -> "Hiding":
        """What overlapping hides at the cost model's efficiency, behind this bottom MLP, whatever cfg asks."""
        eff = cost.output_overlap_efficiency
        if eff <= 0 or bottom.compute <= 0:
            return NO_HIDING
        return Hiding(efficiency=eff, latency_ms=cost.collective_latency_ms, bottom=bottom, cost=cost,
                      tables=tuple(tables))

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

    def per_device(self, topo: Topology, placements: Sequence[Placement]) -> list[Perf]:
        """Per device: what the bottom MLP hides of this plan's output all-to-all (fwd_comm) and of its gradients'
        (bwd_comm)."""
        wire = self._device_wire(topo, placements)
        if wire is None:
            return [Perf()] * topo.world
        fwd, bwd = self._capped(wire[:, 0], wire[:, 1])
        return [Perf(fwd_comm=float(f), bwd_comm=float(b)) for f, b in zip(fwd, bwd)]

    def device_hidden(self, topo: Topology, placements: Sequence[Placement]) -> np.ndarray:
        """Per device: what the bottom MLP hides of this plan's output all-to-alls (forward + backward)."""
        wire = self._device_wire(topo, placements)
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
        """How much less a piece of `a` may let its device hide than a piece of `b` in its place (0: no less)."""
        (af, ab), (bf, bb) = self.piece(a), self.piece(b)
        return max(0.0, bf - af) + max(0.0, bb - ab)


NO_HIDING = Hiding()
