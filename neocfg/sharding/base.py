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
from typing import TYPE_CHECKING, Sequence

from neocfg.plan import Shard
from neocfg.planner.types import Perf
from neocfg.types import ShardingType

if TYPE_CHECKING:
    from neocfg.config.model import TableConfig
    from neocfg.planner.costs import CostModel

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


class Routing(Enum):
    """How a table's ids reach its pieces."""

    whole_table = "whole_table"   # every piece receives all of the table's ids (TW, CW, TWCW)
    by_row = "by_row"             # each id goes to the one piece holding its row, rebased to it (RW, TWRW)
    local = "local"               # no routing: every replica looks up its own samples (DP)


# Collectives per step of each output kind on the embedding process group (forward + backward); all tables of a
# kind share them, so a plan's count depends on the kinds present, not on the number of tables.
IDS_COLLECTIVES = 2                      # all-to-all of the per-destination counts, then one of lengths + ids
OUTPUT_COLLECTIVES = {
    OutputKind.all_to_all: 2,            # pooled outputs all-to-all forward, their gradients backward
    OutputKind.reduce_scatter: 2,        # reduce-scatter of partial sums forward, all-gather backward
    OutputKind.hierarchical: 4,          # node reduce-scatter + cross-node all-to-all, and back
    OutputKind.replicated: 1,            # one all-reduce of every replicated table's gradient (one flat buffer)
}


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
    slices get one more unit): 16 columns over 2 -> [8, 8]; over 3 -> [8, 4, 4]."""
    units = dim // align
    base, extra = divmod(units, parts)
    out, off = [], 0
    for i in range(parts):
        size = (base + (1 if i < extra else 0)) * align
        out.append((off, size))
        off += size
    return out


class Scheme(ABC):
    """One sharding type. Subclasses set the class attributes and implement the abstract methods."""

    sharding: ShardingType
    routing: Routing
    kind: OutputKind              # the output kind of the planner's placements of this type

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

    # ---- cost model (per touched device; see neocfg.planner.costs for the notation) ---------------------
    @abstractmethod
    def piece_shape(self, cost: "CostModel", table: "TableConfig", num_pieces: int) -> PieceShape:
        """What one device holds and serves."""

    @abstractmethod
    def comm(self, cost: "CostModel", shape: PieceShape) -> Perf:
        """The piece's communication time (ids in, outputs out, gradients back)."""

    def gradient_bytes(self, shape: PieceShape) -> int:
        """Bytes of a dense gradient buffer the piece keeps besides its weights (data-parallel replicas)."""
        return 0

    # ---- shared terms --------------------------------------------------------------------------------
    @staticmethod
    def ids_ms(cost: "CostModel", shape: PieceShape) -> float:
        """The piece's ids arriving by the id all-to-all."""
        return shape.lookup_rows * cost.consts.id_bytes * (cost.a2a_ms_per_byte() + cost.exchange_copy_ms_per_byte)
