"""Planner-internal value types passed between the stages: per-device time (Perf), memory (Storage), the
candidate shardings of a table (ShardingOption) and where a chosen option's shards go (Placement)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Optional

from neocfg.types import MemoryTier, ShardingType, WeightsDtype


@dataclass(frozen=True)
class Perf:
    """Estimated milliseconds per training step on one device."""

    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0

    @property
    def compute(self) -> float:
        return self.fwd_compute + self.bwd_compute

    @property
    def comm(self) -> float:
        return self.fwd_comm + self.bwd_comm

    @cached_property
    def total(self) -> float:
        return self.compute + self.comm

    def __add__(self, other: "Perf") -> "Perf":
        return Perf(self.fwd_compute + other.fwd_compute, self.bwd_compute + other.bwd_compute,
                    self.fwd_comm + other.fwd_comm, self.bwd_comm + other.bwd_comm)

    def __mul__(self, k: float) -> "Perf":
        return Perf(self.fwd_compute * k, self.bwd_compute * k, self.fwd_comm * k, self.bwd_comm * k)

    __rmul__ = __mul__


@dataclass(frozen=True)
class Storage:
    """Bytes one device holds: in device memory (HBM; a CPU rank's memory) and in host DDR."""

    hbm: int = 0
    host: int = 0

    def __add__(self, other: "Storage") -> "Storage":
        return Storage(self.hbm + other.hbm, self.host + other.host)

    def __mul__(self, k: int) -> "Storage":
        return Storage(self.hbm * k, self.host * k)

    __rmul__ = __mul__

    def fits(self, capacity: "Storage") -> bool:
        return self.hbm <= capacity.hbm and self.host <= capacity.host


class Spread(Enum):
    """Which devices receive a piece of an option."""

    one = "one"                # table-wise: one device
    distinct = "distinct"      # column-wise: k distinct devices anywhere
    node_distinct = "node_distinct"  # table-column-wise: k distinct devices of one node
    node = "node"              # table-row-wise: every device of one node
    world = "world"            # row-wise, data-parallel: every device

    @staticmethod
    def of(sharding: ShardingType) -> "Spread":
        return _SPREAD[sharding]


_SPREAD = {ShardingType.table_wise: Spread.one, ShardingType.column_wise: Spread.distinct,
           ShardingType.table_column_wise: Spread.node_distinct, ShardingType.table_row_wise: Spread.node,
           ShardingType.row_wise: Spread.world, ShardingType.data_parallel: Spread.world}


@dataclass(frozen=True)
class ShardingOption:
    """One way to shard a table: every device the option touches gets the same `piece` (time and memory)."""

    table_index: int
    sharding: ShardingType
    tier: MemoryTier
    dtype: WeightsDtype
    num_pieces: int            # devices touched: 1 (TW), k slices (CW/TWCW), devices_per_node (TWRW), world (RW/DP)
    perf: Perf                 # per touched device
    storage: Storage           # per touched device
    fixed_ranks: Optional[tuple[int, ...]] = None

    @cached_property
    def spread(self) -> Spread:
        return Spread.of(self.sharding)

    @cached_property
    def is_uniform(self) -> bool:
        """Loads every device of the world identically (no placement decision)."""
        return self.spread is Spread.world

    @cached_property
    def total_work(self) -> float:
        """Milliseconds summed over all devices it touches."""
        return self.perf.total * self.num_pieces

    @property
    def total_comm(self) -> float:
        return self.perf.comm * self.num_pieces

    def label(self) -> str:
        k = f"x{self.num_pieces}" if self.sharding in (ShardingType.column_wise, ShardingType.table_column_wise) else ""
        return f"{self.sharding.value}{k}/{self.tier.value}/{self.dtype.value}"


@dataclass(frozen=True)
class Placement:
    """A chosen option and the ranks receiving its pieces (slice order for CW/TWCW, ascending otherwise)."""

    option: ShardingOption
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    nodes: int
    devices_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.devices_per_node, (node + 1) * self.devices_per_node))


class PlacementSource(Enum):
    """Which method produced the placement that was kept."""

    ilp = "ilp"                  # the flat ILP's own placement (every piece placed by the solver)
    ilp_choice = "ilp_choice"    # the aggregated ILP chose each table's option; placed largest first + local search
    lp_choice = "lp_choice"      # the aggregated model's LP relaxation, each table's largest option; placed the same way
    warm_start = "warm_start"    # the greedy plan improved by local search (the ILP's warm start): no ILP plan beat it
    greedy = "greedy"            # planner.algorithm=greedy
    given = "given"              # a given plan rated without solving (planner.plan_file in mode=plan, TorchRec plans)


@dataclass(frozen=True)
class SolveResult:
    """What an algorithm hands back: one placement per table (in table order) and its proof data. lower_bound_ms
    bounds the busiest device's embedding time (fixed costs included) of every plan of the options."""

    placements: tuple[Placement, ...]
    algorithm: str
    status: str
    seconds: float
    lower_bound_ms: float
    placement_source: PlacementSource
