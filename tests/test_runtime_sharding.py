"""One home per sharding type. Every registered Scheme cuts a table exactly once; the planner's
plans and the runtime's rule plans use the one geometry; a plan file with another geometry is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from neocfg.errors import DataError
from neocfg.plan import Shard
from neocfg.planner.assemble import shards_of
from neocfg.planner.types import Perf, Placement, ShardingOption, Storage
from neocfg.runtime.layout import build_layout
from neocfg.runtime.plans import rule_plan
from neocfg.sharding import SCHEMES, OutputKind, Routing, column_slices, embedding_collectives, row_ranges
from neocfg.types import MemoryTier, ShardingType as S, WeightsDtype


def test_row_split_is_the_ceil_block_split():
    assert [n for _, n in row_ranges(10, 4)] == [3, 3, 3, 1]
    assert row_ranges(3, 4) == [(0, 1), (1, 1), (2, 1), (3, 0)]
    assert [n for _, n in column_slices(16, 3)] == [8, 4, 4] and column_slices(16, 2) == [(0, 8), (8, 8)]


@pytest.mark.parametrize("sharding", list(S))
@pytest.mark.parametrize("rows,dim,ranks", [(10, 16, [0, 1, 2, 3]), (3, 8, [1, 2, 3, 0]), (1000, 32, [5, 2])])
def test_every_scheme_covers_its_table(sharding, rows, dim, ranks):
    scheme = SCHEMES[sharding]
    shards = scheme.shards(rows, dim, ranks)
    cover = torch.zeros(rows, dim, dtype=torch.int32)
    for s in shards:
        cover[s.row_offset:s.row_offset + s.num_rows, s.col_offset:s.col_offset + s.num_cols] += 1
    copies = len(ranks) if sharding is S.data_parallel else 1
    assert bool((cover == copies).all()), shards
    assert scheme.check(rows, dim, shards) is None
    routing = {S.row_wise: Routing.by_row, S.table_row_wise: Routing.by_row, S.data_parallel: Routing.local}
    assert scheme.routing is routing.get(sharding, Routing.whole_table)


def test_planner_and_rule_plans_cut_tables_alike():
    cfg = compose_cfg([])
    t = cfg.model.tables[0]
    for sharding in S:
        ranks = (0, 1, 2, 3)
        opt = ShardingOption(0, sharding, MemoryTier.hbm, WeightsDtype.fp32, len(ranks), Perf(), Storage())
        planned = shards_of(dataclasses.replace(t, num_embeddings=10), Placement(opt, ranks))
        rule = rule_plan(dataclasses.replace(cfg.model, tables=[dataclasses.replace(t, num_embeddings=10)]),
                         world=4, devices_per_node=4, batch_size=8, sharding=sharding,
                         ranks={t.name: list(ranks)}).tables[0].shards
        assert sorted(planned, key=lambda s: s.rank) == sorted(rule, key=lambda s: s.rank), sharding


def test_a_plan_with_another_row_split_is_refused():
    cfg = compose_cfg(["model.tables.0.num_embeddings=10"])
    plan = rule_plan(cfg.model, world=4, devices_per_node=2, batch_size=8, sharding=S.row_wise)
    old = (Shard(0, 0, 3, 0, 16), Shard(1, 3, 3, 0, 16), Shard(2, 6, 2, 0, 16), Shard(3, 8, 2, 0, 16))  # [3,3,2,2]
    bad = dataclasses.replace(plan, tables=(dataclasses.replace(plan.tables[0], shards=old), *plan.tables[1:]))
    build_layout(plan, cfg.model, 0)
    with pytest.raises(DataError, match=r"t0 \(row_wise\).*not row_wise's geometry.*re-plan"):
        build_layout(bad, cfg.model, 0)


def test_output_kinds_and_collectives():
    assert SCHEMES[S.row_wise].output_kind([0, 1, 2, 3], 4, 2) is OutputKind.reduce_scatter
    assert SCHEMES[S.row_wise].output_kind([2, 3], 4, 2) is OutputKind.hierarchical
    assert SCHEMES[S.row_wise].output_kind([1, 2], 4, 2) is OutputKind.all_to_all
    assert {SCHEMES[s].kind for s in (S.table_wise, S.column_wise, S.table_column_wise)} == {OutputKind.all_to_all}
    assert embedding_collectives([]) == 2
    assert embedding_collectives([S.table_wise, S.column_wise]) == 4          # one shared all-to-all
    assert embedding_collectives(list(S)) == 2 + 2 + 2 + 1 + 4
