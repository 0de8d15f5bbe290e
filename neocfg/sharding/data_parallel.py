"""data_parallel: a full replica on every rank (Neo's data parallelism; neocfg.runtime.replicated). Each replica
looks up its own samples only (no id or output exchange); backward, the replicas' dense table gradient is summed by
one all-reduce (for every data-parallel table at once) and every replica applies the same update."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.planner.types import Perf
from neocfg.sharding.base import FP32, OutputKind, PieceShape, Routing, Scheme
from neocfg.types import ShardingType


class DataParallel(Scheme):
    sharding = ShardingType.data_parallel
    routing = Routing.local
    kind = OutputKind.replicated

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return tuple(Shard(r, 0, rows, 0, dim) for r in sorted(ranks))

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        b = cost.batch_size
        return PieceShape(rows=table.num_embeddings, cols=table.embedding_dim,
                          lookup_rows=b * table.pooling_factor, output_samples=b)

    def comm(self, cost, shape: PieceShape) -> Perf:
        # the fp32 table gradient all-reduced: a reduce-scatter and an all-gather of the whole buffer
        return Perf(bwd_comm=2 * self.gradient_bytes(shape) * cost.reduce_scatter_ms_per_byte())

    def gradient_bytes(self, shape: PieceShape) -> int:
        return shape.rows * shape.cols * FP32
