"""What every sharding type shares: the Scheme interface, the output kinds, the routing kinds and the geometry.

A Scheme is the one home of a sharding type: how a table is cut (shards), how its ids reach the pieces (Routing),
how its pooled outputs come back (OutputKind, and so which collectives it issues), and what a piece costs (shape
and communication terms of the planner's cost model). The planner (options, costs, assemble) and the runtime
(layout, id router, output exchange) both read it, so they cannot drift apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from neocfg.plan import Shard, TablePlan
from neocfg.types import MemoryTier, ShardingType, WeightsDtype

if TYPE_CHECKING:
    from neocfg.config.model import TableConfig
    from neocfg.sharding.collectives import PieceComm, Traffic

FP32 = 4
# fbgemm's TBE kernels need embedding dims (and so column slices) that are multiples of 4.
FBGEMM_DIM_ALIGN = 4


class OutputKind(Enum):
    """How a table's pooled outputs return to the ranks whose samples they are (see neocfg.runtime.layout).
    The order of the members is the order of EmbeddingExchange's inputs."""

    all_to_all = "all_to_all"
    reduce_scatter = "reduce_scatter"
    replicated = "replicated"
    hierarchical = "hierarchical"


class Spread(Enum):
    """Which devices receive the pieces of one table (what the planner places)."""

    one = "one"                      # one device (table-wise)
    distinct = "distinct"            # k distinct devices anywhere (column-wise)
    node_distinct = "node_distinct"  # k distinct devices of one node (table-column-wise)
    node = "node"                    # every device of one node (table-row-wise)
    world = "world"                  # every device (row-wise, data-parallel)


class Routing(Enum):
    """How a table's ids reach its pieces."""

    whole_table = "whole_table"   # every piece receives all of the table's ids (TW, CW, TWCW)
    by_row = "by_row"             # each id goes to the one piece holding its row, rebased to it (RW, TWRW)
    local = "local"               # no routing: every replica looks up its own samples (DP)


class Topo(Protocol):
    """The cluster's shape as the piece shapes read it (neocfg.planner.types.Topology)."""

    nodes: int
    devices_per_node: int

    @property
    def world(self) -> int: ...


class CostTerms(Protocol):
    """What a sharding type's piece shape reads of the planner's cost model (neocfg.planner.costs.CostModel)."""

    topo: Topo
    batch_size: int

    @property
    def global_batch(self) -> int: ...


@dataclass(frozen=True)
class PieceShape:
    """What one device holds of a table and how many of its lookups it serves."""

    rows: int                 # rows held (the largest shard for row splits)
    cols: int                 # columns held
    lookup_rows: float        # rows gathered per step on this device
    output_samples: float     # samples whose pooled vectors this device produces (before any reduction)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_ranges(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """(offset, count) of `parts` consecutive row ranges of block ceil(rows / parts) (TorchRec's block size, and
    what fbgemm's block_bucketize_sparse_features routes by): 10 rows over 4 parts -> counts [3, 3, 3, 1]."""
    block = row_block(num_rows, parts)
    return [(min(i * block, num_rows), max(0, min(block, num_rows - i * block))) for i in range(parts)]


def row_block(num_rows: int, parts: int) -> int:
    """Rows per range of row_ranges (at least 1)."""
    return max(1, ceil_div(num_rows, parts))


def column_slices(dim: int, parts: int, align: int = FBGEMM_DIM_ALIGN) -> list[tuple[int, int]]:
    """(offset, count) of `parts` consecutive column slices, multiples of `align`, as even as possible (the first
    slices get one more unit): 16 columns over 2 -> [8, 8]; over 3 -> [8, 4, 4]. One part is the whole width."""
    if parts == 1:
        return [(0, dim)]
    units = dim // align
    base, extra = divmod(units, parts)
    out, off = [], 0
    for i in range(parts):
        size = (base + (1 if i < extra else 0)) * align
        out.append((off, size))
        off += size
    return out


class Scheme(ABC):
    """One sharding type. Subclasses set the class attributes and implement the abstract methods; the planner
    (options, placement, report), the plan validator (neocfg.plan_check), the runtime (layout, routing, exchange)
    and the TorchRec export read nothing per type but these."""

    sharding: ShardingType
    routing: Routing
    kind: OutputKind              # the output kind of the planner's placements of this type
    spread: Spread                # which devices receive its pieces
    abbrev: str                   # its short name in the plan summary
    # what its pieces may be stored as (None: whatever the planner allows)
    weights_dtypes: Optional[tuple[WeightsDtype, ...]] = None
    memory_tiers: Optional[tuple[MemoryTier, ...]] = None
    tiles = True                  # its shards cover the table exactly once (False: full replicas)
    piece_noun = "shard"          # what the validator's messages call a piece

    # ---- placement -----------------------------------------------------------------------------------
    @property
    def sliced(self) -> bool:
        """k column slices on k devices (the planner tries several k)."""
        return self.spread in (Spread.distinct, Spread.node_distinct)

    @property
    def one_node(self) -> bool:
        """All pieces on the ranks of one node."""
        return self.spread in (Spread.node, Spread.node_distinct)

    def num_pieces(self, world: int, devices_per_node: int, slices: int = 1) -> int:
        """Devices a placement touches."""
        return {Spread.one: 1, Spread.distinct: slices, Spread.node_distinct: slices, Spread.node: devices_per_node,
                Spread.world: world}[self.spread]

    def max_slices(self, world: int, devices_per_node: int) -> int:
        """The most column slices a placement may have (sliced types)."""
        return devices_per_node if self.one_node else world

    def placeable(self, rows: int, ranks: Optional[Sequence[int]], world: int, devices_per_node: int) -> bool:
        """Whether a table of `rows` rows can take this type, on `ranks` when the table fixes them."""
        if self.spread in (Spread.world, Spread.node):
            return ranks is None
        if ranks is None:
            return True
        if self.spread is Spread.one:
            return len(ranks) == 1
        if len(set(ranks)) != len(ranks):
            return False
        return not self.one_node or len({r // devices_per_node for r in ranks}) == 1

    def default_ranks(self, table_index: int, world: int, devices_per_node: int) -> list[int]:
        """Where a plan built by rule puts table i (neocfg.runtime.plans): one device round-robin, 2 slices on
        consecutive devices, the ranks of node (i mod nodes), or every device."""
        if self.spread is Spread.one:
            return [table_index % world]
        if self.spread is Spread.distinct:
            return [(table_index + j) % world for j in range(min(2, world))]
        if self.one_node:
            node = table_index % (world // devices_per_node)
            return list(range(node * devices_per_node, (node + 1) * devices_per_node))
        return list(range(world))

    # ---- geometry -------------------------------------------------------------------------------------
    @abstractmethod
    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        """The shards of a table of rows x dim placed on `ranks` (in piece order)."""

    def check(self, rows: int, dim: int, shards: Sequence[Shard]) -> str | None:
        """Why these shards (from a plan file) are not this type's geometry, or None when they are."""
        ranks = [s.rank for s in self.ordered(shards)]
        if sorted(self._key(s) for s in shards) != sorted(self._key(s) for s in self.shards(rows, dim, ranks)):
            want = [(s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in self.shards(rows, dim, ranks)]
            return f"expected (row_offset, num_rows, col_offset, num_cols) {want}"
        return None

    def fault(self, t: TablePlan, world: int, devices_per_node: int) -> str | None:
        """The one validator of a planned table (neocfg.plan_check and the runtime's layout both call it): its
        storage, where its pieces sit and their geometry; None when the runtime can run it. Shards are already
        known to lie inside the world and the table."""
        name = t.sharding.value
        if self.weights_dtypes is not None and t.weights_dtype not in self.weights_dtypes:
            return (f"weights_dtype={t.weights_dtype.value} is not allowed for {name}; allowed: "
                    f"{', '.join(d.value for d in self.weights_dtypes)}")
        if self.memory_tiers is not None and t.memory not in self.memory_tiers:
            return (f"memory={t.memory.value} is not allowed for {name}; allowed: "
                    f"{', '.join(m.value for m in self.memory_tiers)}")
        ranks = sorted(s.rank for s in t.shards)
        if self.spread is Spread.one and len(t.shards) != 1:
            return f"{name} needs exactly one shard, got {len(t.shards)}"
        if self.one_node and len({r // devices_per_node for r in ranks}) != 1:
            return f"{name} needs all shards on the ranks of one node ({devices_per_node} per node)"
        if not self.tiles and any((s.row_offset, s.num_rows, s.col_offset, s.num_cols)
                                  != (0, t.num_embeddings, 0, t.embedding_dim) for s in t.shards):
            return f"{name} needs every {self.piece_noun} to be the whole table"
        piece = self.piece_noun
        if self.spread is Spread.world and ranks != list(range(world)):
            return f"{name} needs one {piece} on each of ranks 0..{world - 1}, got ranks {ranks}"
        if self.spread is Spread.node and len(ranks) != devices_per_node:
            return f"{name} needs one {piece} on each of the {devices_per_node} ranks of its node, got ranks {ranks}"
        if len(set(ranks)) != len(ranks):
            return f"{name} needs its shards on distinct ranks, got ranks {ranks}"
        wrong = self.check(t.num_embeddings, t.embedding_dim, t.shards)
        if wrong:
            got = [(s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in self.ordered(t.shards)]
            return f"shards {got} are not {name}'s geometry: {wrong}"
        return None

    @staticmethod
    def ordered(shards: Sequence[Shard]) -> list[Shard]:
        """Shards in piece order (by row, then column offset)."""
        return sorted(shards, key=lambda s: (s.row_offset, s.col_offset, s.rank))

    @staticmethod
    def _key(s: Shard) -> tuple[int, int, int, int, int]:
        return (s.rank, s.row_offset, s.num_rows, s.col_offset, s.num_cols)

    def output_kind(self, shard_ranks: Sequence[int], world: int, devices_per_node: int) -> OutputKind:
        """The output kind of a placement on these ranks (row splits depend on where they sit)."""
        return self.kind

    def planned_kind(self, world: int, devices_per_node: int) -> OutputKind:
        """The output kind the planner's placements of this type take on this topology (a node-spread row split on
        the only node is the world's reduce-scatter): a placement on the first ranks it spreads over."""
        return self.output_kind(range(self.num_pieces(world, devices_per_node)), world, devices_per_node)

    # ---- cost model (per touched device; see neocfg.planner.costs for the notation) ---------------------
    @abstractmethod
    def piece_shape(self, cost: CostTerms, table: "TableConfig", num_pieces: int) -> PieceShape:
        """What one device holds and serves."""

    def gradient_bytes(self, shape: PieceShape) -> int:
        """Bytes of a dense gradient buffer the piece keeps besides its weights (data-parallel replicas)."""
        return 0

    # ---- the step's collectives (neocfg.sharding.collectives) ------------------------------------------------
    def piece_comms(self, traffic: "Traffic", shape: PieceShape, pooling: float, kind: Optional[OutputKind] = None,
                    share: float = 1.0) -> tuple["PieceComm", ...]:
        """What the piece adds to the step's collectives: its ids arriving (by its routing; `share`: the fraction of
        the table's ids its rows receive), its outputs leaving and their gradients returning (by its output kind,
        default the type's own; row splits depend on where they sit), or its replica's gradient all-reduced.
        The planner prices these (neocfg.planner.costs.CostModel.comm) and the runtime issues them
        (neocfg.sharding.collectives.step_collectives adds them up per rank)."""
        from neocfg.sharding import collectives as c

        ids = {Routing.whole_table: lambda: (c.whole_table_ids(traffic, pooling),),
               Routing.by_row: lambda: (c.by_row_ids(traffic, pooling, share),),
               Routing.local: tuple}[self.routing]()
        kind = self.kind if kind is None else kind
        if kind is OutputKind.replicated:
            return ids + c.replica_grads(self.gradient_bytes(shape))
        return ids + c.OUTPUTS[kind.value](traffic, shape.cols)
