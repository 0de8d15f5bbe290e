"""data_parallel: a full replica on every rank (Neo's data parallelism; neocfg.runtime.replicated). Each replica
looks up its own samples only (no id or output exchange); backward, the replicas' dense table gradient is summed by
one all-reduce (for every data-parallel table at once) and every replica applies the same update."""

from __future__ import annotations

from typing import Sequence

from neocfg.plan import Shard
from neocfg.sharding.base import FP32, OutputKind, PieceShape, Routing, Scheme, Spread
from neocfg.types import MemoryTier, ShardingType, WeightsDtype


class DataParallel(Scheme):
    sharding = ShardingType.data_parallel
    routing = Routing.local
    kind = OutputKind.replicated
    spread = Spread.world
    abbrev = "DP"
    # Replicas are stored in fp32 whatever the plan says (fbgemm's dense TBE on fp16 weights returns an fp16 weight
    # gradient; fp16 replicas failed the fp16_weights sharded == unsharded case, 30% of a table's movement off), so
    # fp16 options would be sized at half the bytes the runtime holds; and they live in the rank's own memory.
    weights_dtypes = (WeightsDtype.fp32,)
    memory_tiers = (MemoryTier.hbm,)
    tiles = False
    piece_noun = "replica"

    def shards(self, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
        return tuple(Shard(r, 0, rows, 0, dim) for r in sorted(ranks))

    def piece_shape(self, cost, table, num_pieces: int) -> PieceShape:
        b = cost.batch_size
        return PieceShape(rows=table.num_embeddings, cols=table.embedding_dim,
                          lookup_rows=b * table.pooling_factor, output_samples=b)


    def gradient_bytes(self, shape: PieceShape) -> int:
        return shape.rows * shape.cols * FP32
