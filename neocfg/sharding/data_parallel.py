"""data_parallel: a full replica on every rank. As neocfg.runtime executes it today: the id exchange brings every
replica the global batch's ids, each looks them all up and keeps its own samples, and the output gradients are
all-gathered backward so every replica applies the same fused update."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.planner.types import Perf
from neocfg.sharding.base import OutputKind, PieceShape, Routing, Scheme
from neocfg.types import ShardingType


class DataParallel(Scheme):
    sharding = ShardingType.data_parallel
    routing = Routing.whole_table
    kind = OutputKind.replicated

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return tuple(Shard(r, 0, rows, 0, dim) for r in sorted(ranks))

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        g = cost.global_batch
        return PieceShape(rows=table.num_embeddings, cols=table.embedding_dim,
                          lookup_rows=g * table.pooling_factor, output_samples=g)

    def comm(self, cost, shape: PieceShape) -> Perf:
        ag = shape.output_samples * shape.cols * (cost.reduce_scatter_ms_per_byte() + cost.exchange_copy_ms_per_byte)
        return Perf(fwd_comm=self.ids_ms(cost, shape), bwd_comm=ag * cost.a2a_bwd_bytes)
