"""Who holds what: the plan turned into per-rank embedding shards, TBE groups and the column maps of the exchange.

Every rank computes the layout of the whole world from the plan (deterministically), so senders know what each
receiver expects and receivers know what each sender holds, without any metadata exchange. Each sharding type's
geometry, routing and output kind come from its Scheme (neocfg/sharding/<type>.py); a plan whose table fails the
plan validator (neocfg.plan_check.table_fault: the same check mode=plan applies) is refused.

How a table's pooled output returns to the rank whose samples it belongs to (OutputKind):
  all_to_all      TW, CW, TWCW and TWRW (and RW tables not spread over the whole world): every owner sends each
                  source rank its [B, num_cols] piece; pieces are added into the table's columns (CW slices land side
                  by side, row-range partial sums add up).
  reduce_scatter  row-wise tables with one row range on every rank: the partial sums are summed and scattered by one
                  reduce-scatter.
  hierarchical    row-wise tables with one row range on every rank of one node of several (TWRW): partial sums are
                  reduce-scattered inside the node, then sent across nodes by an all-to-all among the ranks with the
                  same local index (Neo's and TorchRec's two-level TWRW exchange: one copy per sample crosses nodes).
  replicated      data-parallel tables: not exchanged at all. Every rank holds a replica (neocfg.runtime.replicated)
                  that looks up its own samples; the replicas' gradients are all-reduced. They are left out of the
                  ranks' TBE groups below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from neocfg.config.model import ModelConfig
from neocfg.errors import ConfigError, DataError
from neocfg.plan import Plan
from neocfg.plan_check import table_fault
from neocfg.sharding import SCHEMES, OutputKind, Routing
from neocfg.types import MemoryTier, WeightsDtype


@dataclass(frozen=True, order=True)
class GroupKey:
    """One fused TBE per (weights precision, memory tier) on each rank."""

    weights_dtype: str
    memory: str

    @property
    def dtype(self) -> WeightsDtype:
        return WeightsDtype(self.weights_dtype)

    @property
    def tier(self) -> MemoryTier:
        return MemoryTier(self.memory)


@dataclass(frozen=True)
class LocalShard:
    table: int          # index in the model's table list (= the batch's feature order)
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    kind: OutputKind
    cache_ratio: float = 0.0


@dataclass
class RankLayout:
    groups: list[tuple[GroupKey, list[LocalShard]]] = field(default_factory=list)

    @property
    def features(self) -> list[LocalShard]:
        """The rank's lookups in TBE order: group by group, shards in table order inside a group."""
        return [s for _, shards in self.groups for s in shards]

    def width(self, kind: OutputKind) -> int:
        return sum(s.num_cols for s in self.features if s.kind is kind)


@dataclass
class Layout:
    world: int
    rank: int
    dims: list[int]                     # per model table
    rows: list[int]                     # per model table
    out_offsets: list[int]              # column of table t in the [B, sum(dims)] pooled output
    kinds: list[OutputKind]             # per model table
    routings: list[Routing]             # per model table: how its ids reach its pieces
    ranks: list[RankLayout]
    devices_per_node: int = 1
    table_node: dict[int, int] = field(default_factory=dict)   # hierarchical tables: their node
    pooling: list[float] = field(default_factory=list)          # per model table: its mean ids per sample

    @property
    def nodes(self) -> int:
        return self.world // self.devices_per_node

    def hierarchical_tables(self, node: int) -> list[int]:
        return [t for t in self.tables_of(OutputKind.hierarchical) if self.table_node[t] == node]

    def hierarchical_widths(self) -> list[int]:
        """Columns of the hierarchical tables of each node."""
        return [sum(self.dims[t] for t in self.hierarchical_tables(n)) for n in range(self.nodes)]

    @property
    def me(self) -> RankLayout:
        return self.ranks[self.rank]

    @property
    def total_dim(self) -> int:
        return sum(self.dims)

    def table_holders(self, table: int) -> list[tuple[int, LocalShard]]:
        """(rank, shard) of every piece of a table, in row then column order."""
        held = [(r, s) for r, rl in enumerate(self.ranks) for s in rl.features if s.table == table]
        return sorted(held, key=lambda x: (x[1].row_offset, x[1].col_offset, x[0]))

    def tables_of(self, kind: OutputKind) -> list[int]:
        return [t for t, k in enumerate(self.kinds) if k is kind]

    def _cols(self, t: int, col_offset: int, num_cols: int) -> list[int]:
        start = self.out_offsets[t] + col_offset
        return list(range(start, start + num_cols))

    def source_columns(self, kind: OutputKind) -> torch.Tensor:
        """Columns of this rank's concatenated TBE output that feed `kind` (all_to_all: in feature order;
        reduce_scatter and replicated: in table order, identical on every rank)."""
        cols, start = {}, 0
        for i, s in enumerate(self.me.features):
            cols[i] = list(range(start, start + s.num_cols))
            start += s.num_cols
        feats = list(enumerate(self.me.features))
        if kind is not OutputKind.all_to_all:
            feats.sort(key=lambda x: x[1].table)
        return torch.tensor([c for i, s in feats if s.kind is kind for c in cols[i]], dtype=torch.long)

    def target_columns(self, kind: OutputKind) -> torch.Tensor:
        """Where the received pieces go in the pooled output. all_to_all: the pieces of source 0's features, then
        source 1's, ...; the other kinds: the kind's tables in table order."""
        if kind is OutputKind.all_to_all:
            cols = [c for r in self.ranks for s in r.features if s.kind is kind
                    for c in self._cols(s.table, s.col_offset, s.num_cols)]
        elif kind is OutputKind.hierarchical:  # node by node, as the cross-node all-to-all delivers them
            cols = [c for n in range(self.nodes) for t in self.hierarchical_tables(n)
                    for c in self._cols(t, 0, self.dims[t])]
        else:
            cols = [c for t in self.tables_of(kind) for c in self._cols(t, 0, self.dims[t])]
        return torch.tensor(cols, dtype=torch.long)


def build_layout(plan: Plan, model: ModelConfig, rank: int) -> Layout:
    """Check the plan against the model and the world, then place every shard."""
    world = plan.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    names = [t.name for t in model.tables]
    planned = {t.name for t in plan.tables}
    if set(names) != planned:
        raise DataError(f"plan is for tables {sorted(planned)} but model {model.name} has {sorted(names)}; "
                        f"re-plan (drop planner.plan_file)")
    ranks = [RankLayout() for _ in range(world)]
    grouped: list[dict[GroupKey, list[LocalShard]]] = [{} for _ in range(world)]
    kinds, routings = [], []
    table_node: dict[int, int] = {}
    if world % plan.devices_per_node:
        raise DataError(f"plan world size {world} is not a multiple of devices_per_node {plan.devices_per_node}")
    for t, cfg_table in enumerate(model.tables):
        tp = plan.table(cfg_table.name)
        if (tp.num_embeddings, tp.embedding_dim) != (cfg_table.num_embeddings, cfg_table.embedding_dim):
            raise DataError(f"plan table {tp.name} is {tp.num_embeddings}x{tp.embedding_dim} but the model's is "
                            f"{cfg_table.num_embeddings}x{cfg_table.embedding_dim}; re-plan")
        if tp.embedding_dim % 4:
            raise ConfigError(f"model.tables.{t}.embedding_dim", tp.embedding_dim,
                              "fbgemm's fused embedding kernels need a multiple of 4")
        fault = table_fault(tp, world, plan.devices_per_node)   # the validator plan_check applies
        if fault:
            raise DataError(f"plan table {tp.name} ({tp.sharding.value}): {fault}; re-plan")
        shard_ranks = [s.rank for s in tp.shards]
        scheme = SCHEMES[tp.sharding]
        kind = scheme.output_kind(shard_ranks, world, plan.devices_per_node)
        if kind is OutputKind.hierarchical:
            table_node[t] = shard_ranks[0] // plan.devices_per_node
        kinds.append(kind)
        routings.append(scheme.routing)
        if kind is OutputKind.replicated:
            continue
        key = GroupKey(tp.weights_dtype.value, tp.memory.value)
        for s in tp.shards:
            grouped[s.rank].setdefault(key, []).append(
                LocalShard(t, s.row_offset, s.num_rows, s.col_offset, s.num_cols, kind, tp.cache_ratio))
    for r in range(world):
        ranks[r].groups = sorted(grouped[r].items(), key=lambda kv: kv[0])
    dims = [t.embedding_dim for t in model.tables]
    offsets = [sum(dims[:t]) for t in range(len(dims))]
    return Layout(world=world, rank=rank, dims=dims, rows=[t.num_embeddings for t in model.tables],
                  out_offsets=offsets, kinds=kinds, routings=routings, ranks=ranks,
                  devices_per_node=plan.devices_per_node, table_node=table_node,
                  pooling=[t.pooling_factor for t in model.tables])
