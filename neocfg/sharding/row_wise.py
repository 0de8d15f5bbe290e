"""row_wise: one row range (block ceil(rows / world)) on every rank of the world; each id goes to the rank holding
its row, rebased to it; the partial pooled sums of every global sample are reduce-scattered forward and the output
gradients all-gathered backward."""

from __future__ import annotations

from typing import Optional, Sequence

from neocfg.plan import Shard
from neocfg.sharding.base import OutputKind, PieceShape, Routing, Scheme, Spread, ceil_div, row_ranges
from neocfg.types import ShardingType


class RowSplit(Scheme):
    """Consecutive row ranges, all columns (row_wise over the world, table_row_wise over one node)."""

    routing = Routing.by_row

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return tuple(Shard(r, r0, n, 0, dim) for r, (r0, n) in zip(ranks, row_ranges(rows, len(ranks))))

    def placeable(self, rows: int, ranks: Optional[Sequence[int]], world: int, devices_per_node: int) -> bool:
        """No fixed ranks, and at least two pieces with a non-empty row range each (the ceil split)."""
        parts = self.num_pieces(world, devices_per_node)
        return ranks is None and parts >= 2 and rows > (parts - 1) * ceil_div(rows, parts)

    def output_kind(self, shard_ranks: Sequence[int], world: int, devices_per_node: int) -> OutputKind:
        """Over the whole world: one reduce-scatter; over all ranks of one node of several: the two-level
        exchange; anywhere else: every range's partial sums by the all-to-all."""
        ranks = sorted(shard_ranks)
        if ranks == list(range(world)):
            return OutputKind.reduce_scatter
        first = ranks[0]
        if first % devices_per_node == 0 and ranks == list(range(first, first + devices_per_node)):
            return OutputKind.hierarchical
        return OutputKind.all_to_all


class RowWise(RowSplit):
    sharding = ShardingType.row_wise
    kind = OutputKind.reduce_scatter
    spread = Spread.world
    abbrev = "RW"

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        return PieceShape(rows=ceil_div(table.num_embeddings, cost.topo.world), cols=table.embedding_dim,
                          lookup_rows=cost.batch_size * table.pooling_factor, output_samples=cost.global_batch)
