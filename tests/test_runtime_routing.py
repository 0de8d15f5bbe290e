"""The vectorized id router hands every rank exactly the bags a per-piece reference computes (ids
rebased to the piece's rows, bags ordered feature, source, sample; ids kept in their order inside a bag), for
every sharding type and mixes of them, in both encodings of row-sharded ids and with a batch size that is and one
that is not a power of two, without any process group (routers of every rank in one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from neocfg.batch import Batch
from neocfg.runtime.layout import build_layout
from neocfg.runtime.plans import rule_plan
from neocfg.planner.strategies import id_dtype, routing_encoding
from neocfg.runtime.routing import IdRouter, RwEncoding, deliver, deliver_weights
from neocfg.types import IdDtype
from neocfg.types import ShardingType as S, WeightsDtype

B = 5


def _batch(cfg, seed: int, b: int = B, weighted: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = len(cfg.model.tables)
    lengths = torch.randint(0, 4, (t, b), generator=g)
    values = torch.cat([torch.randint(0, tab.num_embeddings, (int(lengths[i].sum()),), generator=g)
                        for i, tab in enumerate(cfg.model.tables)])
    # a weight that names its id's place in the batch (and its source): any misplaced weight shows
    weights = seed * 1000.0 + torch.arange(values.numel(), dtype=torch.float32) if weighted else None
    return Batch(torch.zeros(b, 1), lengths, values, torch.zeros(b), torch.arange(b), weights=weights)


def _reference(layout, batches, rank):
    """Per TBE group: (indices, offsets, weights) by one loop over features x sources x samples."""
    out = []
    for _, shards in layout.ranks[rank].groups:
        idx, lens, wts = [], [], []
        for s in shards:
            for bt in batches:
                ids, ln = bt.table_values(s.table)
                start = int(bt.lengths.sum(dim=1)[:s.table].sum())
                w = bt.weights[start:start + ids.numel()] if bt.weights is not None else torch.ones(ids.numel())
                for chunk, wc in zip(ids.split(ln.tolist()), w.split(ln.tolist())):
                    mask = (chunk >= s.row_offset) & (chunk < s.row_offset + s.num_rows)
                    idx.append(chunk[mask] - s.row_offset)
                    wts.append(wc[mask])
                    lens.append(int(mask.sum()))
        out.append((torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long),
                    torch.cumsum(torch.tensor([0] + lens), 0), torch.cat(wts) if wts else torch.zeros(0)))
    return out


MIX = [S.table_wise, S.row_wise, S.data_parallel, S.column_wise, S.table_row_wise, S.table_column_wise,
       S.row_wise, S.table_wise]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("encoding", [*RwEncoding])
@pytest.mark.parametrize("sharding", [*S, "mix"])
@pytest.mark.parametrize("world,b", [(2, B), (4, B), (4, 4)])
def test_router_delivers_the_reference_bags(sharding, world, b, encoding, dtype):
    cfg = compose_cfg(["model.tables.7.num_embeddings=3", "model.tables.1.num_embeddings=10",
                       "model.tables.6.num_embeddings=10"])
    sh = {t.name: s for t, s in zip(cfg.model.tables, MIX)} if sharding == "mix" else sharding
    plan = rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=b, sharding=sh)
    if sharding == "mix":  # two TBE groups per rank: feature order is group by group, then table (DP stays fp32)
        plan = dataclasses.replace(plan, tables=tuple(
            dataclasses.replace(t, weights_dtype=WeightsDtype.fp16)
            if i % 2 == 0 and t.sharding is not S.data_parallel else t
            for i, t in enumerate(plan.tables)))
    layouts = [build_layout(plan, cfg.model, r) for r in range(world)]
    routers = [IdRouter(lay, b, torch.device("cpu"), encoding, dtype) for lay in layouts]
    batches = [_batch(cfg, 10 * world + r, b) for r in range(world)]
    routed = [rt.route(bt) for rt, bt in zip(routers, batches)]
    for r in range(world):
        got = routers[r].receive(*deliver(routed, routers, r)).per_group
        want = _reference(layouts[r], batches, r)
        assert len(got) == len(want)
        for (gi, go), (wi, wo, _) in zip(got, want):
            assert torch.equal(go, wo) and torch.equal(gi, wi), (r, gi, wi)
            assert gi.dtype == go.dtype == dtype      # the TBEs' indices and offsets, as they travelled


@pytest.mark.parametrize("encoding", [*RwEncoding])
@pytest.mark.parametrize("sharding", [*S, "mix"])
@pytest.mark.parametrize("world,b", [(2, B), (4, 4)])
def test_router_carries_each_ids_weight(sharding, world, b, encoding):
    """Per-id weights (a dataset's weight columns) reach every TBE group beside their ids, in the ids' order."""
    cfg = compose_cfg(["model.tables.7.num_embeddings=3", "model.tables.1.num_embeddings=10"])
    sh = {t.name: s for t, s in zip(cfg.model.tables, MIX)} if sharding == "mix" else sharding
    plan = rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=b, sharding=sh)
    if sharding == "mix":
        plan = dataclasses.replace(plan, tables=tuple(
            dataclasses.replace(t, weights_dtype=WeightsDtype.fp16)
            if i % 2 == 0 and t.sharding is not S.data_parallel else t for i, t in enumerate(plan.tables)))
    layouts = [build_layout(plan, cfg.model, r) for r in range(world)]
    routers = [IdRouter(lay, b, torch.device("cpu"), encoding, torch.int32) for lay in layouts]
    batches = [_batch(cfg, 10 * world + r, b, weighted=True) for r in range(world)]
    routed = [rt.route(bt) for rt, bt in zip(routers, batches)]
    for r in range(world):
        got = routers[r].receive(*deliver(routed, routers, r), recv_w=deliver_weights(routed, routers, r))
        want = _reference(layouts[r], batches, r)
        assert len(got.per_group) == len(want) and (got.weights is not None or not want)
        for (gi, go), gw, (wi, wo, ww) in zip(got.per_group, got.weights or [], want):
            assert torch.equal(go, wo) and torch.equal(gi, wi.to(gi.dtype)), r
            assert torch.equal(gw, ww), (r, gw, ww)


def test_ids_travel_as_int32_when_they_fit():
    """int32 unless a table's rows or a bag code (features of a rank x world x batch) reach 2^31 - 1."""
    cfg = compose_cfg([])
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=B, sharding=S.row_wise)
    layout = build_layout(plan, cfg.model, 0)
    assert id_dtype(plan, B) is IdDtype.int32
    n_f = max(len(r.features) for r in layout.ranks)
    assert id_dtype(plan, (2**31 - 2) // (n_f * 2)) is IdDtype.int32
    assert id_dtype(plan, (2**31 - 1) // (n_f * 2) + 1) is IdDtype.int64
    tables = list(cfg.model.tables)
    big = dataclasses.replace(cfg.model, tables=[dataclasses.replace(tables[0], num_embeddings=2**31 - 1)]
                              + tables[1:])
    plan = rule_plan(big, world=2, devices_per_node=2, batch_size=B, sharding=S.row_wise)
    assert id_dtype(plan, B) is IdDtype.int64


def test_encoding_follows_length_entries_against_ids():
    """lengths while a row-sharded piece gets an id per sample or more (few ranks), codes at scale."""
    cfg = compose_cfg([])
    tables = cfg.model.tables
    # length entries per id = world / pooling here (8 tables over every rank); codes above LENGTH_ENTRIES_PER_ID = 3
    for world, pooling, want in [(2, 4.0, RwEncoding.lengths), (8, 4.0, RwEncoding.lengths),
                                 (4, 1.0, RwEncoding.codes), (16, 4.0, RwEncoding.codes)]:
        model = dataclasses.replace(cfg.model, tables=[dataclasses.replace(t, pooling_factor=pooling)
                                                       for t in tables])
        plan = rule_plan(model, world=world, devices_per_node=world, batch_size=B, sharding=S.row_wise)
        assert routing_encoding(plan, model) is want, (world, pooling)
    plan = rule_plan(cfg.model, world=4, devices_per_node=2, batch_size=B, sharding=S.table_wise)
    assert routing_encoding(plan, cfg.model) is RwEncoding.lengths
    router = IdRouter(build_layout(plan, cfg.model, 0), B, torch.device("cpu"), RwEncoding.codes, torch.int32)
    assert router.encoding is RwEncoding.lengths   # nothing row-sharded: no codes to send


@pytest.fixture
def one_rank_gloo():
    """A world of one gloo rank in this process (for the embeddings' id exchange)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_ids_exchanged_ahead_are_the_ones_the_step_looks_up(one_rank_gloo):
    """ShardedEmbeddings.prepare (run in the prefetch thread under train.ids_exchange) exchanges a batch's ids; forward
    looks those up (no exchange in the step), equal to an exchange in the step, and only the embeddings whose router
    made them use them."""
    import torch.distributed as dist

    from neocfg.data.source import Prefetcher, SyntheticSource
    from neocfg.data.synthetic import SyntheticData
    from neocfg.runtime.dist import Comm
    from neocfg.runtime.embedding import ShardedEmbeddings
    from neocfg.runtime.routing import Exchanged
    from neocfg.runtime.timing import Stopwatch

    cfg = compose_cfg(["train.batch_size=8"])
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=8,
                     sharding={t.name: s for t, s in zip(cfg.model.tables, MIX)})
    layout = build_layout(plan, cfg.model, 0)

    def embeddings():
        return ShardedEmbeddings(layout, Comm(one_rank_gloo, 0, 1), cfg.train, 8, plan.a2a_fwd_dtype,
                                 plan.a2a_bwd_dtype, torch.device("cpu"), Stopwatch(torch.device("cpu")), seed=0,
                                 dp_group=dist.new_group(), id_group=dist.new_group(), ahead_group=dist.new_group(),
                                 encoding=RwEncoding.lengths, id_dtype=torch.int32)

    emb, other = embeddings(), embeddings()
    source = Prefetcher(SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, 8))
    source.prepare_with(emb.prepare)
    batch = source.next_batch()
    source.close()
    assert isinstance(batch.prepared, Exchanged)            # exchanged in the thread already
    ahead = emb.exchanged_ahead(batch)
    assert ahead is batch.prepared.lookups
    plain = dataclasses.replace(batch, prepared=None)
    fresh = emb.finish_ids(emb.start_ids(plain))
    assert len(fresh.per_group) == len(ahead.per_group) == len(layout.me.groups)
    for (gi, go), (wi, wo) in zip(ahead.per_group, fresh.per_group):
        assert torch.equal(gi, wi) and torch.equal(go, wo)
    assert other.exchanged_ahead(batch) is None               # another router's exchange is not used
    sent = []
    emb.start_ids = lambda b: sent.append(b) or type(emb).start_ids(emb, b)
    with torch.no_grad():
        assert torch.equal(emb(batch), emb(plain))
    assert sent == [plain]                                    # the prepared batch was not exchanged again
