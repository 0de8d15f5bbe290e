"""table_wise: the whole table on one rank; every id of the table goes there; outputs come back by all-to-all."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.perf import Perf
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

    def comm(self, cost, shape: PieceShape) -> Perf:
        return all_to_all_comm(cost, shape, self.ids_ms(cost, shape))


def all_to_all_comm(cost, shape: PieceShape, ids_ms: float) -> Perf:
    """ids in; the pooled outputs of every global sample out by all-to-all, their gradients back the same way."""
    out = shape.output_samples * shape.cols * (cost.a2a_ms_per_byte() + cost.exchange_copy_ms_per_byte)
    return Perf(fwd_comm=ids_ms + out * cost.a2a_fwd_bytes, bwd_comm=out * cost.a2a_bwd_bytes)
