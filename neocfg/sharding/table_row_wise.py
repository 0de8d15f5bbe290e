"""table_row_wise: one row range on every rank of one node; partial sums are reduce-scattered inside the node, then
sent across nodes by an all-to-all among the ranks with the same local index (the two-level exchange)."""

from __future__ import annotations

from neocfg.sharding.base import OutputKind, PieceShape, Spread, ceil_div
from neocfg.sharding.row_wise import RowSplit
from neocfg.types import ShardingType


class TableRowWise(RowSplit):
    sharding = ShardingType.table_row_wise
    kind = OutputKind.hierarchical
    spread = Spread.node
    abbrev = "TWRW"

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        p = cost.topo.devices_per_node
        return PieceShape(rows=ceil_div(table.num_embeddings, p), cols=table.embedding_dim,
                          lookup_rows=cost.global_batch * table.pooling_factor / p, output_samples=cost.global_batch)
