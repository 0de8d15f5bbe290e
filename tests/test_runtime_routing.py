"""Issue 9 item 1: the vectorized id router hands every rank exactly the bags a per-piece reference computes (ids
rebased to the piece's rows, bags ordered feature, source, sample; ids kept in their order inside a bag), for
every sharding type and mixes of them, without any process group (routers of every rank in one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from neocfg.batch import Batch
from neocfg.runtime.layout import build_layout
from neocfg.runtime.plans import rule_plan
from neocfg.runtime.routing import IdRouter, deliver
from neocfg.types import ShardingType as S, WeightsDtype

B = 5


def _batch(cfg, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = len(cfg.model.tables)
    lengths = torch.randint(0, 4, (t, B), generator=g)
    values = torch.cat([torch.randint(0, tab.num_embeddings, (int(lengths[i].sum()),), generator=g)
                        for i, tab in enumerate(cfg.model.tables)])
    return Batch(torch.zeros(B, 1), lengths, values, torch.zeros(B), torch.arange(B))


def _reference(layout, batches, rank):
    """Per TBE group: (indices, offsets) by one loop over features x sources x samples."""
    out = []
    for _, shards in layout.ranks[rank].groups:
        idx, lens = [], []
        for s in shards:
            for bt in batches:
                ids, ln = bt.table_values(s.table)
                for chunk in ids.split(ln.tolist()):
                    keep = chunk[(chunk >= s.row_offset) & (chunk < s.row_offset + s.num_rows)] - s.row_offset
                    idx.append(keep)
                    lens.append(keep.numel())
        out.append((torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long),
                    torch.cumsum(torch.tensor([0] + lens), 0)))
    return out


MIX = [S.table_wise, S.row_wise, S.data_parallel, S.column_wise, S.table_row_wise, S.table_column_wise,
       S.row_wise, S.table_wise]


@pytest.mark.parametrize("sharding", [*S, "mix"])
@pytest.mark.parametrize("world", [2, 4])
def test_router_delivers_the_reference_bags(sharding, world):
    cfg = compose_cfg(["model.tables.7.num_embeddings=3", "model.tables.1.num_embeddings=10",
                       "model.tables.6.num_embeddings=10"])
    sh = {t.name: s for t, s in zip(cfg.model.tables, MIX)} if sharding == "mix" else sharding
    plan = rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=B, sharding=sh)
    if sharding == "mix":  # two TBE groups per rank: feature order is group by group, then table
        plan = dataclasses.replace(plan, tables=tuple(
            dataclasses.replace(t, weights_dtype=WeightsDtype.fp16) if i % 2 == 0 else t
            for i, t in enumerate(plan.tables)))
    layouts = [build_layout(plan, cfg.model, r) for r in range(world)]
    routers = [IdRouter(lay, B, torch.device("cpu")) for lay in layouts]
    batches = [_batch(cfg, 10 * world + r) for r in range(world)]
    routed = [rt.route(bt) for rt, bt in zip(routers, batches)]
    for r in range(world):
        got = routers[r].receive(*deliver(routed, routers, r)).per_group
        want = _reference(layouts[r], batches, r)
        assert len(got) == len(want)
        for (gi, go), (wi, wo) in zip(got, want):
            assert torch.equal(go, wo) and torch.equal(gi, wi), (r, gi, wi)
