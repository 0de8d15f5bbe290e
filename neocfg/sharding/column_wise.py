"""column_wise: k column slices of the whole table on k ranks (any node); every slice receives all the table's
ids; the slices' outputs come back by the shared all-to-all and land side by side."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.sharding.base import OutputKind, PieceShape, Routing, Scheme, Spread, column_slices
from neocfg.types import ShardingType


class ColumnWise(Scheme):
    sharding = ShardingType.column_wise
    routing = Routing.whole_table
    kind = OutputKind.all_to_all
    spread = Spread.distinct
    abbrev = "CW"

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return tuple(Shard(r, 0, rows, c0, n) for r, (c0, n) in zip(ranks, column_slices(dim, len(ranks))) if n > 0)

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        g = cost.global_batch
        widest = column_slices(table.embedding_dim, num_pieces)[0][1]
        return PieceShape(rows=table.num_embeddings, cols=widest, lookup_rows=g * table.pooling_factor,
                          output_samples=g)
