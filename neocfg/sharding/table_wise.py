"""table_wise: the whole table on one rank; every id of the table goes there; outputs come back by all-to-all."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.sharding.base import OutputKind, PieceShape, Routing, Scheme, Spread
from neocfg.types import ShardingType


class TableWise(Scheme):
    sharding = ShardingType.table_wise
    routing = Routing.whole_table
    kind = OutputKind.all_to_all
    spread = Spread.one
    abbrev = "TW"

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return (Shard(ranks[0], 0, rows, 0, dim),)

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        g = cost.global_batch
        return PieceShape(rows=table.num_embeddings, cols=table.embedding_dim,
                          lookup_rows=g * table.pooling_factor, output_samples=g)
