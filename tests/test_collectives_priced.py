"""The planner prices the list the runtime issues (neocfg.sharding.collectives.step_collectives, plan.json's
`collectives`). For every sharding type and every step strategy, each rank's priced embedding communication
(CostModel.comm over the pieces it holds, less the router's host passes, plus the fixed per-step term) is recomputed
here from the list alone: each collective's count at the hardware's collective latency and its bytes (in the
holder's direction) at the rate the hardware's published link bandwidths give that collective. The dense all-reduce
(dense_cost) is recomputed from the list's DDP entry the same way. Changing what one type's pieces add changes the
list and the price alike (test_one_types_schedule_moves_the_list_and_the_price)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import compose_cfg
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.strategies import with_strategies
from neocfg.runtime.plans import rule_plan
from neocfg.sharding import SCHEMES, OutputKind
from neocfg.sharding.collectives import ID_HEADER
from neocfg.types import (Carries, CollectiveKind as K, CommDtype, DenseGradSync, GroupScope as G, IdsExchange,
                          ShardingType as S)

BATCH = 64
MIX = [S.table_wise, S.row_wise, S.column_wise, S.data_parallel, S.table_wise, S.row_wise, S.table_row_wise,
       S.table_column_wise]
# (pipeline, ids_exchange, dense_grad_sync, a2a fwd, a2a bwd)
STRATEGIES = [
    (False, IdsExchange.step, DenseGradSync.ddp, CommDtype.fp32, CommDtype.fp32),
    (True, IdsExchange.step, DenseGradSync.ddp, CommDtype.fp16, CommDtype.bf16),
    (False, IdsExchange.step, DenseGradSync.exchange, CommDtype.bf16, CommDtype.fp16),
    (True, IdsExchange.step, DenseGradSync.exchange, CommDtype.fp32, CommDtype.fp32),
    (False, IdsExchange.prefetch, DenseGradSync.ddp, CommDtype.fp16, CommDtype.fp32),
    (False, IdsExchange.prefetch, DenseGradSync.exchange, CommDtype.fp32, CommDtype.bf16),
]
# (world, devices per node, bottom MLP): one node and two (the two-level exchange); dlrm_tiny's own MLP, and a wider
# one whose 2.1 MB of fp32 gradients DDP sends in two buckets (the first of 1 MiB)
LAYOUTS = [(2, 2, "[64,32,16]"), (4, 2, "[64,32,16]"), (4, 2, "[1024,512,16]")]


def _cfg(world, per, mlp, pipeline, exchange, sync, fwd, bwd):
    return compose_cfg(["model=dlrm_tiny", f"model.bottom_mlp={mlp}", "hardware=cpu_local", f"hardware.nodes={world // per}",
                        f"hardware.devices_per_node={per}", f"train.batch_size={BATCH}",
                        f"train.pipeline={str(pipeline).lower()}", f"train.ids_exchange={exchange.value}",
                        f"train.dense_grad_sync={sync.value}", f"planner.a2a_fwd_dtype={fwd.value}",
                        f"planner.a2a_bwd_dtype={bwd.value}"])


def _plans(cfg, world, per, sync):
    """The mixed plan, and one plan per sharding type with every table of that type (the exchange sync needs an
    all-to-all output: not for a plan of row-sharded or replicated tables only)."""
    n = len(cfg.model.tables)
    yield "mix", {t.name: s for t, s in zip(cfg.model.tables, MIX * (n // len(MIX) + 1))}
    for st in S:
        if sync is DenseGradSync.exchange and SCHEMES[st].kind is not OutputKind.all_to_all:
            continue
        if st is S.table_row_wise and per == world:
            continue   # one node: the reduce-scatter kind, priced as row-wise's
        yield st.value, st


def _rate_ms_per_byte(cfg, kind, group):
    """The hardware's published link bandwidths (hardware.*_bandwidth_gbs at planner.costs.comm_efficiency) for one
    collective: an all-to-all sends (p-1)/w of its bytes inside the node and (w-p)/w across; among one rank per node,
    (n-1)/n across; a reduce-scatter or all-gather moves (p-1)/p inside and (n-1)/(n p) across (only the first inside
    a node), an all-reduce both."""
    hw, eff = cfg.hardware, cfg.planner.costs.comm_efficiency
    p, n = hw.devices_per_node, hw.nodes
    w = p * n
    intra, inter = hw.intra_node_bandwidth_gbs * 1e9, hw.inter_node_bandwidth_gbs * 1e9
    rs = (p - 1) / p / intra + (n - 1) / n / p / inter
    s = {(K.all_to_all, G.world): (p - 1) / w / intra + (w - p) / w / inter,
         (K.all_to_all, G.cross_node): (n - 1) / n / inter,
         (K.reduce_scatter, G.world): rs, (K.all_gather, G.world): rs,
         (K.reduce_scatter, G.intra_node): (p - 1) / p / intra, (K.all_gather, G.intra_node): (p - 1) / p / intra,
         (K.all_reduce, G.world): 2 * rs}[kind, group]
    return s * 1e3 / eff


def _from_list(cfg, listed, header_bytes):
    """(embedding comm ms, the DDP entry or None) of one rank, from its collectives only. A collective the list marks
    overlapped (the ids' payload pipelined a step ahead or exchanged in the prefetch thread) travels behind the
    compute: neither its latency nor its bytes are in the step. The outputs' all-to-all marked overlapped (it runs
    beside the bottom MLP) is priced whole here, as the solver prices it; what the bottom MLP hides comes off in the
    plan's estimate (test_the_bottom_mlp_hides_the_outputs_all_to_all)."""
    hw = cfg.hardware
    copy = 1e3 / (hw.device.exchange_copy_gbs * 1e9) if hw.device.exchange_copy_gbs else 0.0
    gather_gbs = hw.device.gather_copy_gbs or hw.device.exchange_copy_gbs
    gather_copy = 1e3 / (gather_gbs * 1e9) if gather_gbs else 0.0
    sums_gbs = hw.device.sums_copy_gbs or hw.device.exchange_copy_gbs
    sums_copy = 1e3 / (sums_gbs * 1e9) if sums_gbs else 0.0
    alpha = hw.collective_latency_us / 1e3
    emb, ddp = 0.0, None
    for col in listed:
        # the holder's direction: outputs leave the pieces, ids and gradients arrive at them (the other ends' bytes,
        # e.g. every table's outputs for the rank's own samples, are not what the planner charges the rank)
        moved = col.sent if col.carries in (Carries.outputs, Carries.replica_grads, Carries.dense_grads) \
            else col.received
        rate = _rate_ms_per_byte(cfg, col.kind, col.group)
        if col.carries is Carries.dense_grads:
            ddp = col
        elif col.overlapped and col.carries not in (Carries.outputs, Carries.output_grads):
            assert col.carries in (Carries.ids, Carries.id_counts, Carries.id_weights), col
        elif col.carries is Carries.replica_grads:
            replica_alpha = (hw.all_reduce_latency_us if hw.all_reduce_latency_us is not None
                             else hw.collective_latency_us) / 1e3
            emb += col.count * replica_alpha + moved * rate
        elif col.carries is Carries.id_counts:
            emb += col.count * alpha   # a few bytes of counts: their latency only
        else:
            if col.carries is Carries.ids:
                moved -= header_bytes   # the payload's header (the next counts): a few bytes, unpriced
            own = (gather_copy if col.kind in (K.reduce_scatter, K.all_gather)
                   else sums_copy if col.carries is Carries.partial_sums else copy)
            emb += col.count * _alpha(cfg, col.kind) + moved * (rate + own)
    return emb, ddp


def _alpha(cfg, kind) -> float:
    """One collective's fixed time: the exchange's reduce-scatters and all-gathers at the hardware's
    reduce_scatter_latency_us where given, every other at collective_latency_us (ms)."""
    hw = cfg.hardware
    gather = kind in (K.reduce_scatter, K.all_gather) and hw.reduce_scatter_latency_us is not None
    return (hw.reduce_scatter_latency_us if gather else hw.collective_latency_us) / 1e3


def _ddp_bounds(cfg, ddp):
    """DDP's all-reduce of the list's bytes after the dense backward, from first principles: its buckets (the first
    of torch's 1 MiB, the rest in one: under planner.costs.ddp_bucket_mib here) are ring all-reduces at the hardware's
    DDP latency; the last bucket's gradients are ready only at the backward's end, so it is always exposed; at most
    every bucket runs after the backward. One bucket: exactly the whole all-reduce."""
    hw = cfg.hardware
    alpha = (hw.ddp_latency_us if hw.ddp_latency_us is not None else hw.collective_latency_us) / 1e3
    rate = _rate_ms_per_byte(cfg, ddp.kind, ddp.group)
    first = min(ddp.sent, 1 << 20)
    assert ddp.count == (1 if ddp.sent <= 1 << 20 else 2)
    whole = ddp.count * alpha + ddp.sent * rate
    last = alpha + (ddp.sent - first if ddp.count == 2 else ddp.sent) * rate
    return last, whole


def _priced(cfg, cost, plan, rank):
    """What the planner charges the rank: CostModel.comm of every piece it holds (less the router's host passes and
    the exchange's host work per bag, not collectives) and the fixed per-step collectives term of the plan's sharding
    types."""
    tables = {t.name: t for t in cfg.model.tables}
    total = 0.0
    kinds = set()
    for t in plan.tables:
        kinds.add(t.sharding)
        table = tables[t.name]
        shape = cost.shape(table, t.sharding, len(t.shards))
        for s in t.shards:
            if s.rank != rank:
                continue
            assert (shape.rows, shape.cols) == (s.num_rows, s.num_cols), (t.name, t.sharding, shape, s)
            perf = cost.comm(table, t.sharding, shape)
            bags = cost.bag_copies_ms(cost.piece_comms(table, t.sharding, shape), shape)
            total += perf.fwd_comm + perf.bwd_comm - cost.routed_ms(t.sharding, shape) - bags.total
    return total + cost.collectives_latency_ms(kinds)


@pytest.mark.parametrize("world,per,mlp", LAYOUTS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: "-".join(
    [("pipelined" if s[0] else "plain"), s[1].value, s[2].value, s[3].value, s[4].value]))
def test_the_priced_comm_is_the_lists(world, per, mlp, strategy):
    cfg = _cfg(world, per, mlp, *strategy)
    pipeline, exchange, sync = strategy[:3]
    base = CostModel.from_config(cfg)
    checked = 0
    for name, sharding in _plans(cfg, world, per, sync):
        plan = with_strategies(cfg, rule_plan(cfg.model, world=world, devices_per_node=per, batch_size=BATCH,
                                              sharding=sharding, a2a_fwd_dtype=strategy[3],
                                              a2a_bwd_dtype=strategy[4]))
        st = plan.strategies
        # the placed plan's one routing encoding (before placement the planner guesses it per row range)
        cost = dataclasses.replace(base, routing_encoding=st.routing_encoding)
        # the strategies the plan resolved are the ones asked for, and the ones the planner priced
        assert (st.pipeline, st.ids_exchange) == (pipeline and exchange is IdsExchange.step, exchange), name
        assert st.id_dtype.bytes == cost.id_bytes, name
        groups = len({(t.weights_dtype, t.memory) for t in plan.tables})
        header = world * (ID_HEADER + (groups if groups > 1 else 0)) * st.id_dtype.bytes
        dense = dense_cost(cfg, st.dense_grad_sync).perf.bwd_comm
        if st.dense_grad_sync is not sync:   # (auto or a kind without the all-to-all: nothing to fold into)
            continue
        node_kinds = {(c.kind, c.carries) for rank in plan.collectives for c in rank if c.group is G.intra_node}
        for rank, listed in enumerate(plan.collectives):
            emb, ddp = _from_list(cfg, listed, header)
            # the fixed term is the same on every device: a node holding no two-level table is still charged the
            # latency of the node collectives it does not issue (the only term the list does not give exactly)
            unissued = sum(_alpha(cfg, kind) for kind, _ in
                           node_kinds - {(c.kind, c.carries) for c in listed if c.group is G.intra_node})
            assert _priced(cfg, cost, plan, rank) == pytest.approx(emb + unissued, rel=1e-9), \
                (name, rank, listed)
            if ddp is None:
                assert dense == 0.0, (name, rank)
            else:
                last, whole = _ddp_bounds(cfg, ddp)
                assert last * (1 - 1e-9) <= dense <= whole * (1 + 1e-9), (name, rank, ddp)
                if ddp.count == 1:
                    assert dense == pytest.approx(whole, rel=1e-9), (name, rank)
            checked += 1
    assert checked >= world * 4


@pytest.mark.parametrize("mfu,exposed", [(1e-4, "last"), (1.0, "more")])
def test_ddp_hides_all_but_the_last_bucket_behind_a_long_backward(mfu, exposed):
    """Two buckets (2.1 MB of fp32 dense gradients): behind a long dense backward (a slow device) the first bucket's
    all-reduce ends long before the backward does and only the last bucket's is exposed; behind a short one (a fast
    device, tiny kernels) the first does not fit and more is exposed, up to every bucket after the backward."""
    fast = ["hardware.device.kernel_overhead_us=0", "hardware.device.dense_fixed_us=0",
            "planner.costs.dense_activation_passes=0", "hardware.device.peak_tflops=1000000"]
    cfg = compose_cfg(["model=dlrm_tiny", "model.bottom_mlp=[1024,512,16]", "hardware=cpu_local",
                       f"train.batch_size={BATCH}", "train.dense_grad_sync=ddp", f"hardware.device.dense_mfu={mfu}",
                       *(fast if exposed == "more" else [])])
    plan = with_strategies(cfg, rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=BATCH,
                                          sharding=S.table_wise))
    (ddp,) = [c for c in plan.collectives[0] if c.carries is Carries.dense_grads]
    last, whole = _ddp_bounds(cfg, ddp)
    assert ddp.count == 2 and whole > last
    dense = dense_cost(cfg, DenseGradSync.ddp).perf.bwd_comm
    if exposed == "last":
        assert dense == pytest.approx(last, rel=1e-9)
    else:
        assert dense == pytest.approx(whole, rel=1e-3)


def test_one_types_schedule_moves_the_list_and_the_price(monkeypatch):
    """A column-wise piece made to send twice its outputs: the plan's list and the planner's price both grow, by the
    same bytes at the same rate; the other types' pieces are unchanged."""
    cfg = _cfg(2, 2, "[64,32,16]", False, IdsExchange.step, DenseGradSync.ddp, CommDtype.fp32, CommDtype.fp32)
    sharding = {t.name: s for t, s in zip(cfg.model.tables, MIX)}

    def run():
        cost = CostModel.from_config(cfg)
        plan = with_strategies(cfg, rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=BATCH,
                                              sharding=sharding))
        return plan.collectives, [_priced(cfg, cost, plan, r) for r in range(2)]

    before_list, before_price = run()
    scheme = SCHEMES[S.column_wise]
    real = type(scheme).piece_comms

    def doubled(self, traffic, shape, pooling, kind=None, share=1.0):
        out = real(self, traffic, shape, pooling, kind, share)
        if self is not scheme:
            return out
        return tuple(dataclasses.replace(pc, held_sent=2 * pc.held_sent) if pc.carries is Carries.outputs else pc
                     for pc in out)

    monkeypatch.setattr(type(scheme), "piece_comms", doubled)
    after_list, after_price = run()
    rate = _rate_ms_per_byte(cfg, K.all_to_all, G.world) + 1e3 / (cfg.hardware.device.exchange_copy_gbs * 1e9)
    grew = 0
    for r in range(2):
        sent = {(c.kind, c.carries): c.sent for c in after_list[r]}
        was = {(c.kind, c.carries): c.sent for c in before_list[r]}
        extra = sent[K.all_to_all, Carries.outputs] - was[K.all_to_all, Carries.outputs]
        assert {k: v for k, v in sent.items() if k != (K.all_to_all, Carries.outputs)} == \
            {k: v for k, v in was.items() if k != (K.all_to_all, Carries.outputs)}
        assert after_price[r] - before_price[r] == pytest.approx(extra * rate, rel=1e-9)
        grew += extra > 0
    assert grew >= 1


def _rated(cfg, sharding, overlap):
    from neocfg.planner.estimate import rate_plan

    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=BATCH, sharding=sharding)
    plan = with_strategies(cfg, plan)
    return rate_plan(cfg, with_strategies(cfg, dataclasses.replace(
        plan, strategies=dataclasses.replace(plan.strategies, output_overlap=overlap))), "test")


def _beside_bottom_mlp(cfg, listed):
    """(forward, backward) ms of the rank's collectives the list marks as running beside the bottom MLP: each at the
    hardware's collective latency and its bytes (holder's direction) at the link's rate; the exchange's host copies
    are the step thread's own work, not the link's."""
    alpha = cfg.hardware.collective_latency_us / 1e3
    out = {Carries.outputs: 0.0, Carries.output_grads: 0.0}
    for col in listed:
        if col.overlapped and col.carries in out:
            moved = col.sent if col.carries is Carries.outputs else col.received
            out[col.carries] += col.count * alpha + moved * _rate_ms_per_byte(cfg, col.kind, col.group)
    return out[Carries.outputs], out[Carries.output_grads]


# the dense part priced at its FLOPs alone (no kernel overheads, no activation passes), at fp32's peak
FLOPS_ONLY = ["hardware.device.kernel_overhead_us=0", "hardware.device.dense_fixed_us=0",
              "planner.costs.dense_activation_passes=0", "train.dense_precision=fp32"]


@pytest.mark.parametrize("bottom,eff", [("long", 1.0), ("none", 1.0), ("half", 1.0), ("long", 0.5), ("long", 0.0)])
def test_the_bottom_mlp_hides_the_outputs_all_to_all(bottom, eff):
    """output_overlap: the outputs' all-to-all (and its gradients') runs while the bottom MLP computes, so a rank's
    comm in the estimate is what the bottom MLP does not cover: all of the link's part behind a bottom MLP that takes
    far longer (long), none behind one that takes no time (none), and behind one whose forward FLOPs take half the
    forward all-to-all, exactly those FLOPs' time forward and twice it backward (half). The step is shorter by it.
    hardware.output_overlap_efficiency scales what can hide: half of the link's part at 0.5, none at 0 (cpu_local's
    own value)."""
    base = ["model=dlrm_tiny", "hardware=cpu_local", f"train.batch_size={BATCH}", "train.dense_grad_sync=ddp",
            "train.ids_exchange=step", f"hardware.output_overlap_efficiency={eff}",
            "hardware.ddp_exchange_wait_us=0"]   # (the waited-for exchange's DDP wait: its own test)
    mfu = {"long": 1e-7, "none": 1.0, "half": None}[bottom]
    extra = ["hardware.device.peak_tflops=1000000000"] if bottom == "none" else []
    cfg = compose_cfg(base + FLOPS_ONLY + extra + [f"hardware.device.dense_mfu={mfu or 1.0}"])
    tables = {t.name: s for t, s in zip(cfg.model.tables, MIX)}
    off = _rated(cfg, tables, False)
    assert not any(c.overlapped for rank in off.collectives for c in rank if c.carries is Carries.outputs)
    beside = [_beside_bottom_mlp(cfg, listed) for listed in _rated(cfg, tables, True).collectives]
    layers = [cfg.model.num_dense_features] + cfg.model.bottom_layers
    flops = sum(2 * a * b for a, b in zip(layers, layers[1:])) * BATCH
    if bottom == "half":   # an MFU that makes the bottom MLP's forward half the smallest forward all-to-all
        want_ms = min(f for f, _ in beside) / 2
        mfu = flops / (want_ms / 1e3) / (cfg.hardware.device.peak_tflops * 1e12)
        cfg = compose_cfg(base + FLOPS_ONLY + [f"hardware.device.dense_mfu={mfu}"])
        off = _rated(cfg, tables, False)
    on = _rated(cfg, tables, True)
    assert all(c.overlapped for rank in on.collectives for c in rank
               if (c.kind, c.group) == (K.all_to_all, G.world) and c.carries in (Carries.outputs, Carries.output_grads))
    fwd_flops_ms = flops / (cfg.hardware.device.peak_tflops * 1e12 * mfu) * 1e3
    for r, (was, now) in enumerate(zip(off.devices, on.devices)):
        fwd, bwd = beside[r]
        hidden = {"long": eff * (fwd + bwd), "none": 0.0, "half": fwd_flops_ms + min(bwd, 2 * fwd_flops_ms)}[bottom]
        assert fwd > 0 and bwd > 0, r
        assert was.comm_ms - now.comm_ms == pytest.approx(hidden, rel=1e-6, abs=1e-9), (r, fwd, bwd)
        assert now.compute_ms == pytest.approx(was.compute_ms, rel=1e-12)
        assert was.total_ms - now.total_ms == pytest.approx(hidden, rel=1e-6, abs=1e-9), r
    assert on.estimate.step_ms == pytest.approx(max(d.total_ms for d in on.devices), rel=1e-12)
    assert on.estimate.step_ms < off.estimate.step_ms or bottom == "none" or eff == 0
