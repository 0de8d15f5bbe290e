"""Planner-internal value types passed between the stages: per-device time (Perf, neocfg.perf), memory (Storage), the
candidate shardings of a table (ShardingOption) and where a chosen option's shards go (Placement)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Optional

from neocfg.perf import Perf
from neocfg.sharding import SCHEMES, Spread
from neocfg.types import MemoryTier, ShardingType, WeightsDtype


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
        return SCHEMES[self.sharding].spread

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
        k = f"x{self.num_pieces}" if SCHEMES[self.sharding].sliced else ""
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
