"""Plans built by rule rather than by the planner: one sharding type (or a per-table mix) over given ranks.

Used by the correctness tests (every sharding type on small worlds) and by benchmarks that pin a placement. Shard
geometry is the planner's: each sharding type's Scheme (neocfg.sharding) cuts the table.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from neocfg.config.model import ModelConfig
from neocfg.plan import DeviceEstimate, Estimate, Plan, Shard, SolverReport, TablePlan
from neocfg.sharding import SCHEMES
from neocfg.types import CommDtype, MemoryTier, ShardingType, WeightsDtype

def table_shards(sharding: ShardingType, rows: int, dim: int, ranks: Sequence[int]) -> tuple[Shard, ...]:
    """Shards of one table placed on `ranks`: the sharding type's own geometry (neocfg.sharding)."""
    return SCHEMES[sharding].shards(rows, dim, ranks)


def default_ranks(sharding: ShardingType, table_index: int, world: int, devices_per_node: int) -> list[int]:
    """Where a rule-built plan puts table i: the sharding type's own default (Scheme.default_ranks)."""
    return SCHEMES[sharding].default_ranks(table_index, world, devices_per_node)


def rule_plan(model: ModelConfig, *, world: int, devices_per_node: int, batch_size: int,
              sharding: ShardingType | Mapping[str, ShardingType] = ShardingType.table_wise,
              ranks: Optional[Mapping[str, Sequence[int]]] = None,
              weights_dtype: WeightsDtype = WeightsDtype.fp32, memory: MemoryTier = MemoryTier.hbm,
              a2a_fwd_dtype: CommDtype = CommDtype.fp32, a2a_bwd_dtype: CommDtype = CommDtype.fp32,
              step_ms: float = 0.0) -> Plan:
    """A Plan with every table (or each table by name, from a mapping) sharded as given; a table whose sharding
    type allows other weight dtypes or memory tiers only (Scheme.weights_dtypes / memory_tiers: data-parallel
    replicas, fp32 in hbm) takes the first of those."""
    tables = []
    for i, t in enumerate(model.tables):
        st = sharding if isinstance(sharding, ShardingType) else sharding[t.name]
        rks = list((ranks or {}).get(t.name) or default_ranks(st, i, world, devices_per_node))
        allowed = SCHEMES[st].weights_dtypes
        dtype = weights_dtype if allowed is None or weights_dtype in allowed else allowed[0]
        tiers = SCHEMES[st].memory_tiers
        tier = memory if tiers is None or memory in tiers else tiers[0]
        tables.append(TablePlan(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                sharding=st, memory=tier, weights_dtype=dtype,
                                shards=table_shards(st, t.num_embeddings, t.embedding_dim, rks)))
    devices = tuple(DeviceEstimate(rank=r, hbm_bytes=0, host_bytes=0, compute_ms=0.0, comm_ms=0.0, total_ms=step_ms)
                    for r in range(world))
    est = Estimate(step_ms=step_ms, samples_per_s=(world * batch_size * 1000.0 / step_ms) if step_ms else 0.0)
    return Plan(model_name=model.name, world_size=world, nodes=world // devices_per_node,
                devices_per_node=devices_per_node, batch_size_per_device=batch_size, a2a_fwd_dtype=a2a_fwd_dtype,
                a2a_bwd_dtype=a2a_bwd_dtype, tables=tuple(tables), devices=devices, estimate=est,
                solver=SolverReport(algorithm="rule", status="n/a", seconds=0.0, objective_ms=step_ms,
                                    lower_bound_ms=0.0, gap=0.0))
