"""Every cost formula against hand-computed values (round-number cluster, efficiencies 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from neocfg.planner.costs import (CostModel, dense_cost, dense_flops_and_params, distinct_fraction,
                                  generalized_harmonic, scaled_items, zipf_hit_rate)
from neocfg.types import MemoryTier, ShardingType, WeightsDtype

from planner_helpers import round_cfg

# 2 nodes x 4 devices (W=8), B=100 (G=800), intra 100 GB/s, inter 10 GB/s, HBM 1000 GB/s, PCIe 10 GB/s.
# A table of 1000 rows x 16 dims, pooling 2.
TABLE = [("t", 1000, 16, 2)]
A2A = (3 / 8 / 100e9 + 4 / 8 / 10e9) * 1e3      # ms per byte, a device exchanging with the world
RS = (3 / 4 / 100e9 + 1 / 2 / 4 / 10e9) * 1e3   # ms per byte, hierarchical reduce-scatter
RS_NODE = (3 / 4 / 100e9) * 1e3                 # ms per byte, reduce-scatter within the node
CROSS = (1 / 2 / 10e9) * 1e3                    # ms per byte, all-to-all among one rank per node
# Ids arriving at a whole-table piece, int32: every sample's length and its 2 ids, from all G samples.
IDS_WHOLE = 800 * (1 + 2) * 4
# ... at a row-wise range (1 of 8: 8 ranges > 3 x 2 ids per sample, so the codes encoding): from each of the 8
# sources one count, then its 100 x 2 / 8 ids and their bag codes.
IDS_RW = 8 * (1 + 2 * 25) * 4
# ... at a table-row-wise range (1 of 4, the lengths encoding): from each source 100 lengths and 100 x 2 / 4 ids.
IDS_TWRW = 8 * (100 + 50) * 4


@pytest.fixture(scope="module")
def cost():
    # unpipelined: the ids' payload is waited for in the step, its bytes priced (pipelined, it travels behind the
    # compute: test_pipelined_ids_leave_the_step)
    return CostModel.from_config(round_cfg(TABLE, "train.pipeline=false"))


def test_pipelined_ids_leave_the_step(cost, table):
    """Pipelined (the default), a step's ids were sent during the step before and have arrived: the piece's comm is
    its outputs and gradients only, the ids' payload neither bytes nor latency."""
    piped = CostModel.from_config(round_cfg(TABLE))
    assert piped.ids_overlapped and not cost.ids_overlapped
    for sharding in (ShardingType.table_wise, ShardingType.row_wise, ShardingType.column_wise):
        shape = cost.shape(table, sharding, 1)
        ids = cost.ids_ms(table, sharding, shape)
        assert ids > 0 and piped.ids_ms(table, sharding, shape) == 0.0
        assert piped.comm(table, sharding, shape).total == approx(cost.comm(table, sharding, shape).total - ids)


@pytest.fixture(scope="module")
def table():
    return round_cfg(TABLE).model.tables[0]


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-15)


def test_bandwidth_factors(cost):
    assert cost.a2a_ms_per_byte() == approx(A2A)
    assert cost.reduce_scatter_ms_per_byte() == approx(RS)
    assert cost.reduce_scatter_ms_per_byte(within_node=True) == approx(RS_NODE)


def test_table_wise(cost, table):
    perf, st = cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    fwd = 800 * 2 * 16 * 4 / 1000e9 * 1e3          # G*L rows of 16 fp32 from HBM
    assert perf.fwd_compute == approx(fwd)
    assert perf.bwd_compute == approx(2 * fwd)       # bwd_compute_multiplier
    assert perf.fwd_comm == approx((IDS_WHOLE + 800 * 16 * 4) * A2A)    # ids in, pooled out
    assert perf.bwd_comm == approx(800 * 16 * 4 * A2A)                  # pooled gradients in
    # weights + row-wise Adagrad state + ids + pooled outputs and their gradients
    assert st.hbm == 1000 * 16 * 4 + 1000 * 4 + 800 * 2 * 4 + 2 * 800 * 16 * 4 and st.host == 0


def test_fp16_and_fp16_comm(table):
    cost = CostModel.from_config(round_cfg(TABLE, "planner.a2a_fwd_dtype=fp16", "planner.a2a_bwd_dtype=bf16",
                                           "train.pipeline=false"))
    perf, st = cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp16, 1)
    assert perf.fwd_compute == approx(800 * 2 * 16 * 2 / 1000e9 * 1e3)
    assert perf.fwd_comm == approx((IDS_WHOLE + 800 * 16 * 2) * A2A)
    assert perf.bwd_comm == approx(800 * 16 * 2 * A2A)
    assert st.hbm == 1000 * 16 * 2 + 1000 * 4 + 800 * 2 * 4 + 2 * 800 * 16 * 4


def test_column_wise_slice(cost, table):
    perf, st = cost.piece(table, ShardingType.column_wise, MemoryTier.hbm, WeightsDtype.fp32, 4)
    assert perf.fwd_compute == approx(800 * 2 * 4 * 4 / 1000e9 * 1e3)
    assert perf.fwd_comm == approx((IDS_WHOLE + 800 * 4 * 4) * A2A)    # every slice receives all ids
    assert st.hbm == 1000 * 4 * 4 + 1000 * 4 + 800 * 2 * 4 + 2 * 800 * 4 * 4


def test_row_wise(cost, table):
    perf, st = cost.piece(table, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(100 * 2 * 16 * 4 / 1000e9 * 1e3)      # B*L rows per device
    assert perf.fwd_comm == approx(IDS_RW * A2A + 800 * 16 * 4 * RS)        # ids + reduce-scatter
    assert perf.bwd_comm == approx(800 * 16 * 4 * RS)                       # all-gather of gradients
    assert st.hbm == 125 * 16 * 4 + 125 * 4 + 100 * 2 * 4 + 2 * 800 * 16 * 4  # ceil(1000/8) = 125 rows


def test_row_wise_partial_sums_by_all_to_all(table):
    """train.partial_sums=all_to_all (the CPU default): the partial sums of all 800 samples leave by the world's
    all-to-all, at its rate (more of it crosses nodes than of the hierarchical reduce-scatter); gradients as before,
    and one reduce-scatter latency fewer per step."""
    cfg = round_cfg(TABLE, "train.pipeline=false", "train.partial_sums=all_to_all",
                    "hardware.reduce_scatter_latency_us=700", "hardware.collective_latency_us=300")
    cost = CostModel.from_config(cfg)
    perf, _ = cost.piece(table, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx(IDS_RW * A2A + 800 * 16 * 4 * A2A)       # ids + partial sums, all-to-all
    assert perf.bwd_comm == approx(800 * 16 * 4 * RS)                       # all-gather of gradients
    rs = CostModel.from_config(round_cfg(TABLE, "train.pipeline=false", "train.partial_sums=reduce_scatter",
                                         "hardware.reduce_scatter_latency_us=700", "hardware.collective_latency_us=300"))
    rw = [ShardingType.row_wise]
    assert rs.collectives_latency_ms(rw) - cost.collectives_latency_ms(rw) == approx((700 - 300) / 1e3)


def test_table_row_wise(cost, table):
    perf, _ = cost.piece(table, ShardingType.table_row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(800 * 2 / 4 * 16 * 4 / 1000e9 * 1e3)
    out = 800 * 16 * 4 * RS_NODE + 800 / 4 * 16 * 4 * CROSS   # intra-node reduce-scatter + cross-node all-to-all
    assert perf.fwd_comm == approx(IDS_TWRW * A2A + out)
    assert perf.bwd_comm == approx(out)


def test_data_parallel(cost, table):
    # Neo's data parallelism (neocfg.runtime.replicated): every replica looks up its own B samples, nothing is
    # exchanged forward, and the dense fp32 table gradient is all-reduced (reduce-scatter + all-gather) backward.
    perf, st = cost.piece(table, ShardingType.data_parallel, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(100 * 2 * 16 * 4 / 1000e9 * 1e3)   # B*L rows
    assert perf.fwd_comm == 0
    assert perf.bwd_comm == approx(2 * 1000 * 16 * 4 * RS)
    # backward: the lookups' 2x plus 12 passes (planner.costs.replica_update_passes) over the fp32 replica at the
    # streaming bandwidth (unset: HBM's, 1000 GB/s)
    update = 12 * 1000 * 16 * 4 / 1000e9 * 1e3
    assert perf.bwd_compute == approx(2 * perf.fwd_compute + update)
    slow, _ = CostModel.from_config(round_cfg(TABLE, "hardware.device.stream_bandwidth_gbs=100")).piece(
        table, ShardingType.data_parallel, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert slow.bwd_compute == approx(2 * perf.fwd_compute + 10 * update)
    # weights + row-wise Adagrad state + local ids + local outputs and their gradients + the dense gradient
    assert st.hbm == 1000 * 16 * 4 + 1000 * 4 + 100 * 2 * 4 + 2 * 100 * 16 * 4 + 1000 * 16 * 4


def test_uvm_caching_and_host(cost, table):
    h = sum(k ** -1.0 for k in range(1, 201)) / sum(k ** -1.0 for k in range(1, 1001))
    assert zipf_hit_rate(1000, 1.0, 0.2) == approx(h)
    perf, st = cost.piece(table, ShardingType.table_wise, MemoryTier.uvm_caching, WeightsDtype.fp32, 1)
    nbytes = 800 * 2 * 16 * 4
    assert perf.fwd_compute == approx(nbytes * (h / 1000e9 + (1 - h) / 10e9) * 1e3)
    buffers = 800 * 2 * 4 + 2 * 800 * 16 * 4
    assert st.hbm == 200 * 16 * 4 + 200 * 16 + buffers      # cache rows + metadata (16 B/row) + buffers
    assert st.host == 1000 * 16 * 4 + 1000 * 4
    perf, st = cost.piece(table, ShardingType.table_wise, MemoryTier.host, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(nbytes / 10e9 * 1e3)
    assert st.hbm == buffers and st.host == 1000 * 16 * 4 + 1000 * 4


def test_host_reads_bounded_by_the_ddr_share(table):
    """Misses and host-tier rows come from host DDR shared by the node's 4 devices: 8 GB/s of DDR is 2 GB/s per
    device, slower than the 10 GB/s PCIe link, so it sets the rate; 400 GB/s (100 per device) leaves PCIe's."""
    nbytes = 800 * 2 * 16 * 4
    slow = CostModel.from_config(round_cfg(TABLE, "hardware.host.ddr_bandwidth_gbs=8"))
    perf, _ = slow.piece(table, ShardingType.table_wise, MemoryTier.host, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(nbytes / 2e9 * 1e3)
    h = zipf_hit_rate(1000, 1.0, 0.2)
    perf, _ = slow.piece(table, ShardingType.table_wise, MemoryTier.uvm_caching, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(nbytes * (h / 1000e9 + (1 - h) / 2e9) * 1e3)
    fast = CostModel.from_config(round_cfg(TABLE, "hardware.host.ddr_bandwidth_gbs=400"))
    perf, _ = fast.piece(table, ShardingType.table_wise, MemoryTier.host, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(nbytes / 10e9 * 1e3)


def test_optimizer_state(table):
    for opt, state in (("exact_adagrad", 1000 * 16 * 4), ("exact_sgd", 0)):
        cost = CostModel.from_config(round_cfg(TABLE, f"train.sparse_optimizer={opt}"))
        _, st = cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
        assert st.hbm == 1000 * 16 * 4 + state + 800 * 2 * 4 + 2 * 800 * 16 * 4


def test_harmonic_tail_is_accurate():
    exact = sum(k ** -1.05 for k in range(1, 200_001))
    assert generalized_harmonic(200_000, 1.05) == pytest.approx(exact, rel=1e-8)
    assert zipf_hit_rate(10, 1.0, 1.0) == 1.0


def test_dense_flops_params_and_time():
    cfg = round_cfg(TABLE)   # 4 dense -> bottom [8]; dcn over x = 16 + 8 = 24, 3 layers rank 512; top [4, 1]
    flops, params = dense_flops_and_params(cfg.model)
    x, r = 24, 512
    assert flops == 2 * 4 * 8 + 3 * (4 * x * r + 3 * x) + 2 * (24 * 4 + 4 * 1)
    assert params == (4 * 8 + 8) + 3 * (2 * x * r + x) + (24 * 4 + 4) + (4 * 1 + 1)
    d = dense_cost(cfg)
    rate = 156e12 * 0.4  # zionex peak x dense_mfu
    assert d.perf.fwd_compute == approx(flops * 100 / rate * 1e3)
    assert d.perf.bwd_compute == approx(2 * flops * 100 / rate * 1e3)
    assert d.perf.bwd_comm == approx(2 * params * 4 * RS)
    assert d.resident_bytes == params * 4 * 2  # fp32 + Adagrad state


def test_capacity_reserves():
    cfg = round_cfg(TABLE)
    cost = CostModel.from_config(cfg)
    assert cost.hbm_capacity == int(40 * 1024**3 * 0.9) - dense_cost(cfg).resident_bytes
    assert cost.host_capacity == int(1536 * 1024**3 * 0.8 / 4)


# ---- fixed per-step costs: collective latency (alpha) and per-kernel overhead --------------------------------
OVERHEAD = ("hardware.collective_latency_us=100", "hardware.device.kernel_overhead_us=10")


@pytest.mark.parametrize("train", [("train.ids_exchange=step",), ("train.ids_exchange=step", "train.pipeline=false"),
                                   ("train.ids_exchange=prefetch",)])
def test_embedding_collectives_are_the_step_list(train):
    """The collectives the fixed costs count are those of the step's list (neocfg.sharding.collectives) on its
    fullest rank, for mixes of output kinds and the step's id exchange (pipelined: one, unpipelined: two, a batch
    ahead in the prefetch thread: none in the step); data-parallel tables' all-reduce is priced on its own."""
    from itertools import combinations

    from neocfg.planner.strategies import plan_collectives, with_strategies
    from neocfg.runtime.plans import rule_plan
    from neocfg.sharding import embedding_collectives
    from neocfg.sharding.collectives import Carries
    from neocfg.types import IdsExchange
    S = ShardingType
    cfg = round_cfg([(f"t{i}", 1000, 16, 2) for i in range(4)], "hardware.device.kind=cpu", "hardware.backend=gloo",
                    *train)
    cost = CostModel.from_config(cfg)
    ids = (Carries.ids, Carries.id_counts)
    for mix in combinations([S.table_wise, S.row_wise, S.table_row_wise, S.data_parallel], 2):
        shardings = {t.name: mix[i % 2] for i, t in enumerate(cfg.model.tables)}
        plan = with_strategies(cfg, rule_plan(cfg.model, world=8, devices_per_node=4, batch_size=100,
                                              sharding=shardings))
        ahead = plan.strategies.ids_exchange is IdsExchange.prefetch
        in_step = max(sum(c.count for c in listed if c.carries not in (Carries.dense_grads, Carries.replica_grads)
                          and not (ahead and c.carries in ids)) for listed in plan_collectives(cfg, plan))
        assert in_step == embedding_collectives(set(mix) - {S.data_parallel}, cost.id_collectives), (mix, train)


def test_embedding_overhead_hand_computed():
    cost = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "hardware.device.routing_us_per_step=30"))
    S = ShardingType
    # TW + RW, pipelined (the default): the ids' one collective travels behind the compute (sent a step ahead, not
    # in the step's time), the outputs' 2 + 2 = 4 collectives x 0.1 ms, plus 12 output-exchange kernels x 0.01 ms +
    # the routing's 0.03 ms
    perf = cost.embedding_overhead_ms([S.table_wise, S.row_wise], groups=2)
    assert perf.comm == approx(4 * 0.1 + 12 * 0.01 + 0.03)
    # unpipelined: the ids' 2 collectives (counts, then the payload) are waited for in the step
    plain = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "hardware.device.routing_us_per_step=30",
                                            "train.pipeline=false"))
    assert plain.embedding_overhead_ms([S.table_wise, S.row_wise], groups=2).comm == approx(6 * 0.1 + 12 * 0.01 + 0.03)
    assert perf.fwd_comm == approx(2 * perf.bwd_comm)
    # 2 TBE groups x 4 kernels x 0.01 ms, half forward
    assert perf.compute == approx(2 * 4 * 0.01)
    assert perf.fwd_compute == approx(perf.bwd_compute)
    # unmeasured routing (the GPU presets): the router's 40 kernels per step at the kernel overhead
    unset = CostModel.from_config(round_cfg(TABLE, *OVERHEAD)).embedding_overhead_ms([S.table_wise], 0)
    assert unset.comm == approx(2 * 0.1 + 12 * 0.01 + 40 * 0.01)
    # zero latency and kernel cost: nothing
    assert CostModel.from_config(round_cfg(TABLE)).embedding_overhead_ms([S.table_wise], 1).total == 0.0
    # a measured TBE call (cpu_local): its own time per group instead of 4 kernels' launches, half forward
    timed = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "hardware.device.tbe_us_per_group=250"))
    assert timed.embedding_overhead_ms([S.table_wise], 3).fwd_compute == approx(3 * 0.25 / 2)


def test_reduce_scatter_and_all_gather_latency():
    """The exchange's reduce-scatters and all-gathers (row-wise outputs and their gradients, the two-level exchange's
    node collectives) cost hardware.reduce_scatter_latency_us each where the preset measures it, the all-to-alls
    collective_latency_us; unset, every one collective_latency_us."""
    S = ShardingType
    unset = CostModel.from_config(round_cfg(TABLE, *OVERHEAD))
    measured = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "hardware.reduce_scatter_latency_us=250"))
    # pipelined ids: none of their collectives is in the step; outputs: 2 collectives per kind
    assert unset.collectives_latency_ms([S.row_wise]) == approx(2 * 0.1)
    assert measured.collectives_latency_ms([S.row_wise]) == approx(2 * 0.25)
    assert measured.collectives_latency_ms([S.table_wise]) == approx(2 * 0.1)
    # two-level: node reduce-scatter + all-gather, cross-node all-to-all out and back; with table-wise beside it
    # (the world all-to-all's two)
    assert measured.collectives_latency_ms([S.table_row_wise]) == approx(2 * 0.25 + 2 * 0.1)
    assert measured.collectives_latency_ms([S.table_row_wise, S.table_wise, S.row_wise]) == approx(
        4 * 0.25 + 4 * 0.1)


def test_data_parallel_all_reduce_latency(table):
    """The data-parallel gradient all-reduce's fixed time: one collective's latency unless the preset measures it
    (cpu_local: hardware.all_reduce_latency_us, gloo's in-step all-reduce); in the fixed costs and in the DP terms
    that metrics.json sets beside the runtime's dp_update / comm_dp laps."""
    from neocfg.planner.estimate import replica_backward_ms
    from neocfg.runtime.plans import rule_plan
    S = ShardingType
    unset = CostModel.from_config(round_cfg(TABLE, *OVERHEAD))
    # the all-reduce (0.1 ms) + 12 exchange kernels x 0.01 ms + routing 40 x 0.01 ms (the ids' one collective,
    # pipelined, travels behind the compute)
    assert unset.embedding_overhead_ms([S.data_parallel]).comm == approx(0.1 + 12 * 0.01 + 40 * 0.01)
    cfg = round_cfg(TABLE, *OVERHEAD, "hardware.all_reduce_latency_us=350")
    measured = CostModel.from_config(cfg)
    assert measured.embedding_overhead_ms([S.data_parallel]).comm == approx(0.35 + 12 * 0.01 + 40 * 0.01)
    # other kinds keep collective_latency_us: TW + DP = outputs 2 collectives x 0.1 ms + the all-reduce
    assert measured.collectives_latency_ms([S.table_wise, S.data_parallel]) == approx(2 * 0.1 + 0.35)
    # the DP table's backward as metrics.json predicts it: the all-reduce's 0.35 ms + 2 x its fp32 gradient's bytes
    # at the reduce-scatter rate; its lookups' backward (2 x forward: B*L rows x 16 x 4 B at 1000 GB/s) + 12 passes
    plan = rule_plan(cfg.model, world=8, devices_per_node=4, batch_size=100, sharding=S.data_parallel)
    compute, comm = replica_backward_ms(cfg, plan)
    assert comm == approx(0.35 + 2 * 1000 * 16 * 4 * RS)
    assert compute == approx(2 * 100 * 2 * 16 * 4 / 1000e9 * 1e3 + 12 * 1000 * 16 * 4 / 1000e9 * 1e3)
    assert replica_backward_ms(cfg, rule_plan(cfg.model, world=8, devices_per_node=4, batch_size=100)) == (0.0, 0.0)


def test_routing_per_id(table):
    """The router's per-id passes ride on the ids a piece receives; replicas route nothing."""
    base = CostModel.from_config(round_cfg(TABLE))
    cost = CostModel.from_config(round_cfg(TABLE, "hardware.device.routing_ns_per_id=50"))
    for sharding, ids in ((ShardingType.table_wise, 800 * 2), (ShardingType.row_wise, 100 * 2),
                          (ShardingType.data_parallel, 0)):
        with_ids, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        without, _ = base.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        assert with_ids.fwd_comm == approx(without.fwd_comm + ids * 50e-6), sharding
        assert with_ids.bwd_comm == approx(without.bwd_comm)


def test_data_generation_on_cpu_devices():
    """Synthetic batches cost the step only where the ranks are the host's cores (CPU devices)."""
    from neocfg.planner.costs import data_ms
    measured = ("hardware.host.synthetic_us_per_sample=2", "hardware.host.synthetic_ns_per_id=100",
                "hardware.host.synthetic_us_per_batch=300")
    assert data_ms(round_cfg(TABLE, *measured)) == 0.0                                  # a GPU preset
    cpu = round_cfg(TABLE, *measured, "hardware.device.kind=cpu", "hardware.backend=gloo")
    # 300 us per batch + B=100 samples x (2 us + 2 ids x 0.1 us)
    assert data_ms(cpu) == approx((300 + 100 * (2 + 2 * 100 / 1e3)) / 1e3)
    assert data_ms(round_cfg(TABLE, "hardware.device.kind=cpu", "hardware.backend=gloo")) == 0.0  # unmeasured


def test_tiny_plan_step_hand_computed():
    """A whole plan's step time term by term: one table-wise table on a CPU cluster of the round numbers, every
    fixed cost on. The busiest device holds the table; its step = lookups + exchange bytes + collectives + the
    output exchange's and the TBE's kernels + routing + dense + data."""
    from neocfg.planner.costs import data_ms
    from neocfg.planner.pipeline import plan_placement
    cpu = [*OVERHEAD, "planner.sharding_types=[table_wise]", "hardware.device.kind=cpu", "hardware.backend=gloo",
           "hardware.device.routing_us_per_step=30", "hardware.device.routing_ns_per_id=50",
           "hardware.host.synthetic_us_per_sample=2"]
    cfg = round_cfg(TABLE, *cpu, "train.output_overlap=overlap")
    plan = plan_placement(cfg)
    lookups = 800 * 2 * 16 * 4 / 1000e9 * 1e3 * 3                       # fwd + 2x bwd, HBM 1000 GB/s
    exchange = 2 * 800 * 16 * 4 * A2A                                    # outputs out, gradients back (the
    routing = 800 * 2 * 50e-6 + 0.03                                     # ids came during the step before);
    fixed = 2 * 0.1 + 12 * 0.01 + 4 * 0.01                               # per id received + per step; TW pipelined:
    #                                                                      the outputs' 2 collectives; kernels
    data = 100 * 2 / 1e3                                                 # B=100 samples x 2 us
    assert data_ms(cfg) == approx(data)
    dense = dense_cost(cfg).perf.total                                   # its own hand-computed tests above
    # DDP, output_overlap pinned: the outputs' all-to-all (0.1 ms latency + its bytes) is sent before the bottom MLP
    # [8] and waited for after it, both ways; that MLP is shorter, so all of it is hidden: its layer's 6 kernels and
    # 2 x 4 x 8 FLOPs per sample, forward and twice backward, at zionex's 156 TFLOPS x dense_mfu 0.4
    assert plan.strategies.output_overlap
    bottom = 6 * 0.01 + 3 * 2 * 4 * 8 * 100 / (156e12 * 0.4) * 1e3
    assert plan.estimate.output_hidden_ms == approx(bottom)
    assert plan.estimate.step_ms == approx(lookups + exchange + routing + fixed + dense + data - bottom)
    assert plan.estimate.data_ms == approx(data)
    # the solver carries what the bottom MLP hides too (planner/hiding.py): its objective is the estimate
    assert plan.solver.objective_ms == approx(plan.estimate.step_ms)
    assert plan.solver.lower_bound_ms <= plan.solver.objective_ms * (1 + 1e-12)
    # under auto a CPU device overlaps only an exchange its bottom MLP covers: this one it cannot, so the plan waits
    # and hides nothing; the solver's objective is that estimate, its bound still below
    waits = plan_placement(round_cfg(TABLE, *cpu))
    assert not waits.strategies.output_overlap and waits.estimate.output_hidden_ms == 0
    assert waits.estimate.step_ms == approx(lookups + exchange + routing + fixed + dense + data)
    assert waits.solver.objective_ms == approx(waits.estimate.step_ms)
    assert waits.solver.lower_bound_ms <= waits.solver.objective_ms * (1 + 1e-12)


@pytest.mark.parametrize("bottom,kind,overlaps", [("[8]", "cpu", False), ("[8192,8]", "cpu", True),
                                                  ("[8]", "gpu", True)])
def test_auto_overlap_on_cpu_needs_the_bottom_mlp_to_cover_the_exchange(bottom, kind, overlaps):
    """train.output_overlap=auto, DDP: a GPU device overlaps whatever its bottom MLP hides; a CPU device only where
    that MLP's compute covers efficiency x (latency + wire) each way (here 0.1 ms + the wire at efficiency 1). At
    1 GFLOP/s peak a [8] MLP (0.02 ms forward) does not; an [8192, 8] one (about 50 ms forward) does, and hides all."""
    from neocfg.planner.pipeline import plan_placement
    dev = ["hardware.device.kind=cpu", "hardware.backend=gloo"] if kind == "cpu" else []
    plan = plan_placement(round_cfg(TABLE, *OVERHEAD, "planner.sharding_types=[table_wise]", *dev,
                                    "hardware.output_overlap_efficiency=1", f"model.bottom_mlp={bottom}",
                                    "hardware.device.peak_tflops=0.001", "hardware.device.peak_tflops_tf32=0.001",
                                    "train.dense_grad_sync=ddp"))
    assert plan.strategies.output_overlap is overlaps
    assert (plan.estimate.output_hidden_ms > 0) is overlaps
    assert plan.solver.objective_ms == approx(plan.estimate.step_ms)


def test_dense_mfu_per_device():
    base = dense_cost(round_cfg(TABLE))
    d = dense_cost(round_cfg(TABLE, "+hardware.device.dense_mfu=0.8"))
    assert d.perf.fwd_compute == approx(base.perf.fwd_compute / 2)   # 0.8 instead of planner.costs.dense_mfu 0.4


def test_dense_overhead_hand_computed():
    base = dense_cost(round_cfg(TABLE))
    d = dense_cost(round_cfg(TABLE, *OVERHEAD))
    # layers: bottom [8] (1) + DCN 3 cross layers x 2 matmuls (6) + top [4, 1] (2) = 9
    kernels = (6 * 9 + 30) * 0.01
    assert d.perf.compute == approx(base.perf.compute + kernels)
    assert d.perf.fwd_compute == approx(base.perf.fwd_compute + kernels / 3)
    # one DDP bucket (params x 4 bytes < 25 MiB): one all-reduce latency
    assert d.perf.bwd_comm == approx(base.perf.bwd_comm + 0.1)
    # DDP's first bucket holds 1 MiB whatever bucket_cap_mb says: these gradients are still one bucket at a 0.1 MiB
    # cap; beyond the first MiB, one more per cap
    assert base.parameters * 4 < 2**20
    d2 = dense_cost(round_cfg(TABLE, *OVERHEAD, "planner.costs.ddp_bucket_mib=0.1"))
    assert d2.perf.bwd_comm == approx(base.perf.bwd_comm + 0.1)
    wide = ["model.bottom_mlp=[1024,512,8]"]
    w1 = dense_cost(round_cfg(TABLE, *wide))
    w0 = dense_cost(round_cfg(TABLE, *wide, "planner.costs.ddp_bucket_mib=0.1"))
    w2 = dense_cost(round_cfg(TABLE, *wide, "planner.costs.ddp_bucket_mib=0.1", "hardware.collective_latency_us=100"))
    buckets = 1 + -(-(w1.parameters * 4 - 2**20) // int(0.1 * 2**20))
    assert buckets > 2
    # a backward of a few microseconds hides none of them: every bucket's latency is in the step
    assert w0.perf.bwd_compute < 0.01
    assert w2.perf.bwd_comm == approx(w0.perf.bwd_comm + buckets * 0.1)


def test_dense_fixed_time_whatever_the_layers():
    """hardware.device.dense_fixed_us replaces the dense kernels' fixed costs: the same time per step for 3 layers or
    9 (a third forward), the bottom MLP its kernels' share of it."""
    for extra in ([], ["model.bottom_mlp=[64,32,8]", "model.top_mlp=[16,8,4,1]"]):
        base = dense_cost(round_cfg(TABLE, "hardware.device.kernel_overhead_us=0", *extra))
        d = dense_cost(round_cfg(TABLE, "hardware.device.kernel_overhead_us=7", "+hardware.device.dense_fixed_us=1000",
                                 *extra))
        assert d.perf.compute == approx(base.perf.compute + 1.0)
        assert d.perf.fwd_compute == approx(base.perf.fwd_compute + 1.0 / 3)
    # the bottom [64, 32, 8]: 3 layers of 13 (DCN's 3 cross layers x 2, the top's 4): 6 x 3 of the 6 x 13 + 30 kernels
    assert d.bottom.compute == approx(base.bottom.compute + 1.0 * 6 * 3 / (6 * 13 + 30))


def test_folded_dense_gradients_ride_in_the_all_to_all():
    """dense_grad_sync=exchange (or auto with a small dense part): no DDP all-reduce in the dense term; the world's
    copies of the fp32 dense gradients travel in the backward all-to-all instead, once, where the plan has one."""
    S = ShardingType
    ddp = round_cfg(TABLE, *OVERHEAD, "train.dense_grad_sync=ddp")
    folded = round_cfg(TABLE, *OVERHEAD, "train.dense_grad_sync=exchange")
    params = dense_cost(ddp).parameters
    assert dense_cost(ddp).perf.bwd_comm > 0
    assert dense_cost(folded).perf.bwd_comm == 0
    cost, base = CostModel.from_config(folded), CostModel.from_config(ddp)
    rider = 8 * params * 4 * A2A                     # W x the fp32 gradients, sent and received by every device
    assert cost.collectives_latency_ms([S.table_wise]) == approx(base.collectives_latency_ms([S.table_wise]) + rider)
    assert cost.collectives_latency_ms([S.row_wise]) == approx(base.collectives_latency_ms([S.row_wise]))
    assert cost.embedding_overhead_ms([S.table_wise]).bwd_comm == approx(
        base.embedding_overhead_ms([S.table_wise]).bwd_comm + rider)


def test_plan_carries_the_overheads():
    from neocfg.planner.pipeline import plan_placement
    tables = [("a", 1000, 16, 2), ("b", 2000, 16, 1)]
    # (the outputs' all-to-all waited for at once: what the bottom MLP hides is test_tiny_plan_step_hand_computed's)
    types = ("planner.sharding_types=[table_wise]", "train.output_overlap=wait")
    cfg = round_cfg(tables, *OVERHEAD, *types)
    plan = plan_placement(cfg)
    base = plan_placement(round_cfg(tables, *types))
    cost = CostModel.from_config(cfg)
    # the busiest device holds one TW table (one TBE group)
    fixed = cost.embedding_overhead_ms([ShardingType.table_wise], 1).total
    dense_extra = dense_cost(cfg).perf.total - dense_cost(round_cfg(tables)).perf.total
    assert plan.estimate.step_ms == approx(base.estimate.step_ms + fixed + dense_extra)
    assert plan.solver.lower_bound_ms <= plan.estimate.step_ms
    assert plan.solver.gap >= 0


def test_exchange_copy_per_byte(table):
    cost = CostModel.from_config(round_cfg(TABLE, "+hardware.device.exchange_copy_gbs=2", "train.pipeline=false"))
    copy = 1 / 2e9 * 1e3                              # ms per byte of host copies
    perf, _ = cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx((IDS_WHOLE + 800 * 16 * 4) * (A2A + copy))
    assert perf.bwd_comm == approx(800 * 16 * 4 * (A2A + copy))
    perf, _ = cost.piece(table, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx(IDS_RW * (A2A + copy) + 800 * 16 * 4 * (RS + copy))
    perf, _ = cost.piece(table, ShardingType.data_parallel, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == 0                                      # replicas look up their own samples
    assert perf.bwd_comm == approx(2 * 1000 * 16 * 4 * RS)         # the gradient all-reduced in place, no copies


def test_ddp_sync_adds_its_wait_where_the_plan_waits_for_its_exchange():
    """ddp_exchange_wait_us: once per step in the estimate's backward comm where DDP syncs the dense gradients and the
    plan waits for its output exchange (table- or row-wise); not where the outputs travel behind the bottom MLP, nor
    where the gradients ride in the exchange. The solvers leave it out (the same placement and bound either way); the
    plan's objective pays it, so it shows in the gap."""
    from neocfg.planner.pipeline import plan_placement

    def plans(*extra):
        base = [TABLE + [("u", 500, 16, 1)], "planner.time_limit_s=5"]
        return [plan_placement(round_cfg(base[0], base[1], *extra, *wait)) for wait in
                ([], ["+hardware.ddp_exchange_wait_us=700"])]

    for sync, overlap, kind, paid in (("ddp", "wait", "table_wise", 0.7), ("ddp", "wait", "row_wise", 0.7),
                                      ("ddp", "overlap", "table_wise", 0.0),
                                      ("exchange", "wait", "table_wise", 0.0)):
        without, with_wait = plans(f"train.dense_grad_sync={sync}", f"train.output_overlap={overlap}",
                                   f"planner.sharding_types=[{kind}]")
        assert with_wait.strategies.output_overlap is (overlap == "overlap"), (sync, overlap, kind)
        assert [t.shards for t in with_wait.tables] == [t.shards for t in without.tables]
        assert with_wait.solver.lower_bound_ms == approx(without.solver.lower_bound_ms)
        assert with_wait.estimate.step_ms - without.estimate.step_ms == approx(paid), (sync, overlap, kind)
        # the plan's price in the solvers' terms pays it too: it shows in the gap, above the bound
        assert with_wait.solver.objective_ms - without.solver.objective_ms == approx(paid), (sync, overlap, kind)
        assert with_wait.solver.objective_ms == approx(with_wait.estimate.step_ms)


def test_gather_copy_per_byte(table):
    """gather_copy_gbs prices the bytes of the exchange's reduce-scatters and all-gathers (row-wise outputs and their
    gradients); the ids' all-to-all and the table-wise exchange keep exchange_copy_gbs."""
    cost = CostModel.from_config(round_cfg(TABLE, "+hardware.device.exchange_copy_gbs=2",
                                           "+hardware.device.gather_copy_gbs=0.5", "train.pipeline=false"))
    copy, gather = 1 / 2e9 * 1e3, 1 / 0.5e9 * 1e3
    perf, _ = cost.piece(table, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx(IDS_RW * (A2A + copy) + 800 * 16 * 4 * (RS + gather))
    assert perf.bwd_comm == approx(800 * 16 * 4 * (RS + gather))
    perf, _ = cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx((IDS_WHOLE + 800 * 16 * 4) * (A2A + copy))


def test_sums_copy_per_byte(table):
    """sums_copy_gbs prices the bytes of the row-wise partial sums' all-to-all (train.partial_sums=all_to_all); the
    gradients' all-gather keeps gather_copy_gbs, the ids exchange_copy_gbs."""
    cost = CostModel.from_config(round_cfg(TABLE, "+hardware.device.exchange_copy_gbs=2",
                                           "+hardware.device.gather_copy_gbs=0.5", "+hardware.device.sums_copy_gbs=8",
                                           "train.partial_sums=all_to_all", "train.pipeline=false"))
    copy, gather, sums = 1 / 2e9 * 1e3, 1 / 0.5e9 * 1e3, 1 / 8e9 * 1e3
    perf, _ = cost.piece(table, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_comm == approx(IDS_RW * (A2A + copy) + 800 * 16 * 4 * (A2A + sums))
    assert perf.bwd_comm == approx(800 * 16 * 4 * (RS + gather))


def test_exchange_cost_per_bag_of_outputs(table):
    """exchange_ns_per_bag: half forward, half backward per bag a piece's outputs carry (a row-wise piece's partial
    sums of every sample too); nothing for a replica, whose outputs stay on its rank."""
    base = CostModel.from_config(round_cfg(TABLE, "train.pipeline=false"))
    cost = CostModel.from_config(round_cfg(TABLE, "train.pipeline=false", "hardware.device.exchange_ns_per_bag=50"))
    for sharding, bags in ((ShardingType.table_wise, 800), (ShardingType.row_wise, 800),
                           (ShardingType.data_parallel, 0)):
        with_bags, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        without, _ = base.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        assert with_bags.fwd_comm == approx(without.fwd_comm + bags * 50e-6 / 2), sharding
        assert with_bags.bwd_comm == approx(without.bwd_comm + bags * 50e-6 / 2), sharding
        assert with_bags.compute == approx(without.compute)
    two = cost.shape(table, ShardingType.column_wise, 2)   # each slice's outputs: every sample's bag, half its columns
    slice_cost, _ = cost.piece(table, ShardingType.column_wise, MemoryTier.hbm, WeightsDtype.fp32, 2)
    slice_base, _ = base.piece(table, ShardingType.column_wise, MemoryTier.hbm, WeightsDtype.fp32, 2)
    assert slice_cost.comm == approx(slice_base.comm + two.output_samples * 50e-6)


def test_tbe_cost_per_bag(table):
    """tbe_ns_per_bag: forward + backward per bag (output sample) a piece pools, split as the bytes are (1 : 2)."""
    base = CostModel.from_config(round_cfg(TABLE))
    cost = CostModel.from_config(round_cfg(TABLE, "hardware.device.tbe_ns_per_bag=300"))
    for sharding, bags in ((ShardingType.table_wise, 800), (ShardingType.row_wise, 800),
                           (ShardingType.data_parallel, 100)):
        with_bags, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        without, _ = base.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, 1)
        assert with_bags.fwd_compute == approx(without.fwd_compute + bags * 300e-6 / 3), sharding
        assert with_bags.bwd_compute == approx(without.bwd_compute + bags * 300e-6 * 2 / 3), sharding
        assert with_bags.comm == approx(without.comm)


def test_tbe_cost_per_bag_column_and_row(table):
    """tbe_ns_per_bag_column: per column of each bag a piece pools (a column-wise slice's own columns);
    tbe_ns_per_row: per distinct row among the ids it looks up; both forward + backward, split as the bytes are
    (1 : 2)."""
    base = CostModel.from_config(round_cfg(TABLE))
    cost = CostModel.from_config(round_cfg(TABLE, "hardware.device.tbe_ns_per_bag_column=10",
                                           "hardware.device.tbe_ns_per_row=20"))
    # Zipf(1) ids over 1,000 rows: G x L = 1,600 ids of the whole table address sum_k 1 - e^(-1600 p_k) distinct
    # rows, a replica's B x L = 200 ids sum_k 1 - e^(-200 p_k); a row range (1 of 8) gets its share of them
    p = 1 / np.arange(1, 1001)
    p /= p.sum()
    table_rows, replica_rows = (float(np.sum(-np.expm1(-n * p))) for n in (1600, 200))
    # (sharding, pieces, bags, columns, distinct rows): G = 800 samples, B = 100 per device, pooling 2, dim 16
    for sharding, pieces, bags, cols, rows in ((ShardingType.table_wise, 1, 800, 16, table_rows),
                                                (ShardingType.row_wise, 1, 800, 16, table_rows / 8),
                                                (ShardingType.column_wise, 2, 800, 8, table_rows),
                                                (ShardingType.data_parallel, 1, 100, 16, replica_rows)):
        walk = (bags * cols * 10 + rows * 20) * 1e-6
        with_walk, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, pieces)
        without, _ = base.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, pieces)
        assert with_walk.fwd_compute == approx(without.fwd_compute + walk / 3), sharding
        assert with_walk.bwd_compute == approx(without.bwd_compute + walk * 2 / 3), sharding
        assert with_walk.comm == approx(without.comm)


def test_far_rows_cost_more_by_the_pieces_span(table):
    """tbe_ns_per_far_line: more per distinct row as the piece's rows span beyond table_reach_mib (its own rows: a
    column slice or a row range spans less than its table)."""
    base = CostModel.from_config(round_cfg(TABLE, "hardware.device.tbe_ns_per_row=20"))
    cost = CostModel.from_config(round_cfg(TABLE, "hardware.device.tbe_ns_per_row=20",
                                           "hardware.device.tbe_ns_per_far_line=100",
                                           f"hardware.device.table_reach_mib={2**-5}"))   # 32,768 bytes
    # the whole table spans 1000 x 16 x 4 = 64,000 bytes: 1 - 32,768 / 64,000 beyond; a half-column slice
    # (32,000) or a row range (125 rows: 8,000) none
    for sharding, pieces, far in ((ShardingType.table_wise, 1, 1 - 32768 / 64000), (ShardingType.column_wise, 2, 0.0),
                                  (ShardingType.row_wise, 1, 0.0)):
        shape = cost.shape(table, sharding, pieces)
        assert cost.far_share(shape, WeightsDtype.fp32) == approx(far), sharding
        with_far, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, pieces)
        without, _ = base.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, pieces)
        extra = CostModel.distinct_rows(table, shape) * 100e-6 * far
        assert with_far.compute == approx(without.compute + extra), sharding
    # fp16 rows span half as far: the whole table's 32,000 bytes are within the reach
    assert cost.far_share(cost.shape(table, ShardingType.table_wise, 1), WeightsDtype.fp16) == 0.0


@pytest.mark.parametrize("dim, dtype, lines", [(8, WeightsDtype.fp32, 1), (16, WeightsDtype.fp32, 1),
                                               (64, WeightsDtype.fp32, 4), (64, WeightsDtype.fp16, 2),
                                               (40, WeightsDtype.fp32, 2.5)])
def test_a_far_row_costs_per_cache_line(dim, dtype, lines):
    """tbe_ns_per_far_line: a far row's first fetch costs per 64-byte line of the row (one at least): a dim-64 fp32
    row four times a dim-16 one, a row narrower than a line one line."""
    spec = [("t", 100_000, dim, 2)]
    overrides = ("hardware.device.tbe_ns_per_row=20", "hardware.device.table_reach_mib=0.01")
    base = CostModel.from_config(round_cfg(spec, *overrides))
    cost = CostModel.from_config(round_cfg(spec, *overrides, "hardware.device.tbe_ns_per_far_line=100"))
    t = round_cfg(spec).model.tables[0]
    shape = cost.shape(t, ShardingType.table_wise, 1)
    far = cost.far_share(shape, dtype)
    assert far > 0.9
    with_far, _ = cost.piece(t, ShardingType.table_wise, MemoryTier.hbm, dtype, 1)
    without, _ = base.piece(t, ShardingType.table_wise, MemoryTier.hbm, dtype, 1)
    extra = CostModel.distinct_rows(t, shape) * 100e-6 * far * lines
    assert with_far.compute == approx(without.compute + extra)


def test_distinct_fraction_follows_the_zipf_law():
    """The expected distinct share of n draws: uniform in closed form, Zipf summed over every row (the tail's bins
    included), a skewed table far fewer distinct rows than a uniform one."""
    assert distinct_fraction(1000, 0.0, 1600) == approx(1000 * -math.expm1(-1.6) / 1600)
    for rows, alpha, n in ((3000, 1.05, 5000.0), (200_000, 0.8, 20_000.0), (500_000, 1.2, 100_000.0)):
        p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
        p /= p.sum()
        assert distinct_fraction(rows, alpha, n) == pytest.approx(float(np.sum(-np.expm1(-n * p))) / n, rel=1e-3)
    assert distinct_fraction(200_000, 1.1, 20_000.0) < 0.5 * distinct_fraction(200_000, 0.0, 20_000.0)


def test_row_ids_routed_dearer(table):
    """routing_ns_per_row_id adds to each id of a row-sharded piece only (bucketized by row range)."""
    cost = CostModel.from_config(round_cfg(TABLE, "hardware.device.routing_ns_per_id=50",
                                           "hardware.device.routing_ns_per_row_id=30"))
    rw = cost.shape(table, ShardingType.row_wise, 1)
    tw = cost.shape(table, ShardingType.table_wise, 1)
    assert cost.routed_ms(ShardingType.row_wise, rw) == approx(100 * 2 * 80e-6)     # B x L ids, 50 + 30 ns
    assert cost.routed_ms(ShardingType.table_wise, tw) == approx(800 * 2 * 50e-6)   # G x L ids, 50 ns
    assert cost.routed_ms(ShardingType.data_parallel, cost.shape(table, ShardingType.data_parallel, 1)) == 0.0


def test_data_generation_per_bag():
    from neocfg.planner.costs import data_ms
    cpu = round_cfg([("a", 1000, 16, 2), ("b", 1000, 16, 3)], "hardware.device.kind=cpu", "hardware.backend=gloo",
                    "hardware.host.synthetic_us_per_sample=2", "hardware.host.synthetic_ns_per_id=100",
                    "hardware.host.synthetic_ns_per_bag=40", "hardware.host.synthetic_us_per_batch=300")
    # 300 us + B=100 x (2 us + 5 ids x 0.1 us + 2 bags x 0.04 us)
    assert data_ms(cpu) == approx((300 + 100 * (2 + 0.5 + 0.08)) / 1e3)

    # synthetic_exponent 0.5: the batch's 500 ids and 200 bags each cost count x (count / 2^16) ** -0.5 items
    half = round_cfg([("a", 1000, 16, 2), ("b", 1000, 16, 3)], "hardware.device.kind=cpu", "hardware.backend=gloo",
                     "hardware.host.synthetic_us_per_sample=2", "hardware.host.synthetic_ns_per_id=100",
                     "hardware.host.synthetic_ns_per_bag=40", "hardware.host.synthetic_us_per_batch=300",
                     "hardware.host.synthetic_exponent=0.5")
    ids, bags = 500 * (500 / 2**16) ** -0.5, 200 * (200 / 2**16) ** -0.5
    assert data_ms(half) == approx((300 + 100 * 2 + ids * 0.1 + bags * 0.04) / 1e3)
    # at 2^16 items the rates are the linear ones
    assert scaled_items(2**16, 0.5) == approx(2**16) and scaled_items(10.0, 1.0) == 10.0


def test_dense_activation_passes():
    from neocfg.planner.costs import dense_activations
    cfg = round_cfg(TABLE)                      # 4 dense, bottom [8], DCN 3 layers over x = 16 + 8, top [4, 1]
    x = 24
    assert dense_activations(cfg.model) == 4 + 8 + x + 4 * x + 4 + 1
    base = dense_cost(cfg)
    d = dense_cost(round_cfg(TABLE, "planner.costs.dense_activation_passes=10",
                             "+hardware.device.stream_bandwidth_gbs=2"))
    passes = 10 * (4 + 8 + 5 * x + 5) * 4 * 100 / 2e9 * 1e3      # B=100 samples of fp32 at 2 GB/s
    assert d.perf.fwd_compute == approx(base.perf.fwd_compute + passes / 3)
    assert d.perf.bwd_compute == approx(base.perf.bwd_compute + passes * 2 / 3)
    dot = round_cfg([("a", 1000, 16, 2), ("b", 1000, 16, 2)], "model.interaction=dot", "model.bottom_mlp=[16]")
    f = 3                                        # two tables + the bottom MLP's output
    assert dense_activations(dot.model) == 4 + 16 + (2 * 16 + 16) + (f * f + 16 + f * (f - 1) // 2) + 4 + 1


def test_folded_dense_gradients_pay_no_all_reduce():
    """dense_grad_sync=exchange: the dense gradients ride in the embeddings' backward all-to-all, so the dense part
    has no collective of its own, and a plan that folds them is priced so."""
    from neocfg.planner.pipeline import plan_placement
    from neocfg.types import DenseGradSync
    # (the outputs' all-to-all waited for at once under DDP too: both plans' comm has it whole)
    overhead = (*OVERHEAD, "planner.sharding_types=[table_wise]", "train.output_overlap=wait")
    ddp = dense_cost(round_cfg(TABLE, *overhead), DenseGradSync.ddp)
    folded = dense_cost(round_cfg(TABLE, *overhead), DenseGradSync.exchange)
    assert ddp.perf.comm > 0 and folded.perf.comm == 0.0
    assert folded.perf.compute == approx(ddp.perf.compute)
    plans = {}
    for sync, dense in (("exchange", folded), ("ddp", ddp)):
        plan = plans[sync] = plan_placement(round_cfg(TABLE, *overhead, f"train.dense_grad_sync={sync}"))
        assert plan.strategies.dense_grad_sync.value == sync
        assert plan.estimate.dense_ms == approx(dense.perf.total)
        # the solver prices the sync the plan runs: its objective is the estimate
        assert plan.solver.objective_ms == approx(plan.estimate.step_ms)
    # the folded plan's backward all-to-all carries the world's dense gradients: 8 x params x fp32 at the a2a rate
    riders = 8 * dense_flops_and_params(round_cfg(TABLE).model)[1] * 4 * A2A
    embedding_comm = {s: p.devices[0].comm_ms - p.estimate.dense_comm_ms for s, p in plans.items()}
    assert embedding_comm["exchange"] == approx(embedding_comm["ddp"] + riders)


def test_prefetched_ids_routing_is_data_and_their_collectives_leave_the_step():
    """Where the ids are exchanged in the prefetch thread (a CPU rank, row-sharded tables), the routing's host time
    is priced in the data term, not the step's comm, and the step issues no id collective: the id payload's bytes
    travel on the prefetch thread's own group, beside the step."""
    from neocfg.planner.pipeline import plan_placement
    cpu = (*OVERHEAD, "planner.sharding_types=[row_wise]", "hardware.device.kind=cpu", "hardware.backend=gloo",
           "hardware.device.routing_us_per_step=30", "hardware.device.routing_ns_per_id=50",
           "hardware.device.routing_ns_per_row_id=20", "hardware.host.synthetic_us_per_sample=2")
    step = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=step", "train.pipeline=false"))
    piped = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=step"))
    ahead = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=prefetch"))
    assert step.strategies.ids_exchange.value == "step" and ahead.strategies.ids_exchange.value == "prefetch"
    assert piped.strategies.pipeline and not step.strategies.pipeline
    routing = 0.03 + 100 * 2 * 70e-6                       # per step + B x L ids received x (50 + 20 ns)
    assert step.estimate.data_ms == approx(100 * 2 / 1e3)  # B=100 x 2 us
    assert ahead.estimate.data_ms == approx(100 * 2 / 1e3 + routing)
    # ... and the unpipelined step's two id all-to-alls (counts, payload: 100 us each) and the payload's bytes (a
    # row range's ids) leave the step
    for s, a in zip(step.devices, ahead.devices):
        assert a.comm_ms == approx(s.comm_ms - routing - 0.2 - IDS_RW * A2A)
        assert a.total_ms == approx(s.total_ms - 0.2 - IDS_RW * A2A)
    # pipelined, the payload already travels behind the compute (sent a step ahead): only the routing moves
    for p, a in zip(piped.devices, ahead.devices):
        assert a.comm_ms == approx(p.comm_ms - routing)
        assert a.total_ms == approx(p.total_ms)


def test_processor_cache_serves_the_hottest_rows(table):
    """hardware.device.cache_mib: the cache holds cache_mib x W / the model's fp32 weights of every table's rows (here
    1,600 B x 8 devices / 64,000 B = 0.2); that Zipf head's lookups read at cache_bandwidth_gbs, the rest at HBM's,
    on every piece of the table alike; tiers off the device keep their own rates."""
    mib = 1600 / 2**20
    cost = CostModel.from_config(round_cfg(TABLE, f"hardware.device.cache_mib={mib}",
                                           "hardware.device.cache_bandwidth_gbs=10000"))
    assert cost.cache_fraction == approx(0.2)
    h = sum(k ** -1.0 for k in range(1, 201)) / sum(k ** -1.0 for k in range(1, 1001))   # zipf_alpha 1.0
    for sharding, pieces, ids in ((ShardingType.table_wise, 1, 800 * 2), (ShardingType.row_wise, 8, 800 * 2 / 8)):
        perf, _ = cost.piece(table, sharding, MemoryTier.hbm, WeightsDtype.fp32, pieces)
        assert perf.fwd_compute == approx(ids * 16 * 4 * (h / 10000e9 + (1 - h) / 1000e9) * 1e3), sharding
    uvm, _ = cost.piece(table, ShardingType.table_wise, MemoryTier.uvm_caching, WeightsDtype.fp32, 1)
    assert uvm.fwd_compute == approx(800 * 2 * 16 * 4 * (h / 1000e9 + (1 - h) / 10e9) * 1e3)
    # uniform ids: the head holds its share of the lookups; twice the weights halve the share
    flat = CostModel.from_config(round_cfg(TABLE, f"hardware.device.cache_mib={mib}",
                                           "hardware.device.cache_bandwidth_gbs=10000",
                                           "model.tables.0.zipf_alpha=0.0"))
    flat_table = round_cfg(TABLE, "model.tables.0.zipf_alpha=0.0").model.tables[0]
    perf, _ = flat.piece(flat_table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)
    assert perf.fwd_compute == approx(800 * 2 * 16 * 4 * (0.2 / 10000e9 + 0.8 / 1000e9) * 1e3)
    two = CostModel.from_config(round_cfg(TABLE + [("u", 1000, 16, 2)], f"hardware.device.cache_mib={mib}",
                                          "hardware.device.cache_bandwidth_gbs=10000"))
    assert two.cache_fraction == approx(0.1)


def test_processor_cache_needs_its_rate():
    from neocfg.errors import ConfigError

    with pytest.raises(ConfigError, match="hardware.device.cache_bandwidth_gbs"):
        round_cfg(TABLE, "hardware.device.cache_mib=4")


def test_a_plan_pinning_another_dense_sync_is_priced_as_it_runs():
    """A plan file whose strategies fold the dense gradients where this config would run DDP (and the reverse) is
    rated with what it pins: riders in the backward all-to-all and no all-reduce, exactly as the plan solved with
    that sync."""
    import dataclasses

    from neocfg.planner.estimate import rate_plan
    from neocfg.planner.pipeline import plan_placement
    from neocfg.types import DenseGradSync
    overhead = (*OVERHEAD, "planner.sharding_types=[table_wise]")
    solved = {s: plan_placement(round_cfg(TABLE, *overhead, f"train.dense_grad_sync={s}")) for s in ("exchange", "ddp")}
    for pinned, other in (("exchange", "ddp"), ("ddp", "exchange")):
        plan = solved[other]
        given = dataclasses.replace(plan, strategies=dataclasses.replace(
            plan.strategies, dense_grad_sync=DenseGradSync(pinned),
            output_overlap=solved[pinned].strategies.output_overlap), collectives=())
        rated = rate_plan(round_cfg(TABLE, *overhead, f"train.dense_grad_sync={other}"), given, "given.json")
        want = rate_plan(round_cfg(TABLE, *overhead, f"train.dense_grad_sync={pinned}"), solved[pinned], "p.json")
        assert rated.estimate.step_ms == approx(want.estimate.step_ms), pinned
        assert [d.comm_ms for d in rated.devices] == approx([d.comm_ms for d in want.devices]), pinned
        assert rated.estimate.step_ms != approx(solved[other].estimate.step_ms), pinned


def test_auto_ids_exchange_is_priced_as_it_resolves():
    """ids_exchange=auto on CPU ranks with row-sharded tables resolves to the prefetch thread: the estimate prices
    what runs (no id collective in the step), the same as asking for prefetch."""
    from neocfg.planner.pipeline import plan_placement
    cpu = (*OVERHEAD, "planner.sharding_types=[row_wise]", "hardware.device.kind=cpu", "hardware.backend=gloo",
           "hardware.device.routing_us_per_step=30", "hardware.device.routing_ns_per_id=50")
    auto = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=auto"))
    ahead = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=prefetch"))
    step = plan_placement(round_cfg(TABLE, *cpu, "train.ids_exchange=step", "train.pipeline=false"))
    assert auto.strategies.ids_exchange.value == "prefetch"
    assert [d.total_ms for d in auto.devices] == approx([d.total_ms for d in ahead.devices])
    assert auto.estimate.data_ms == approx(ahead.estimate.data_ms)
    assert auto.estimate.step_ms < step.estimate.step_ms


def test_per_id_weights_are_priced_as_a_payload_of_their_own():
    """dsi.columns.weights: the ids' float32 weights travel in one more all-to-all of the id payload's split sizes:
    each piece's ids cost (1 + 4 / id bytes) times as much on the wire, and the step has one more id collective."""
    from neocfg.sharding.collectives import Carries
    weighted = ("dsi=parquet_local", "++dsi.columns.label=y", "++dsi.columns.dense=[d0,d1,d2,d3]",
                "++dsi.columns.sparse={t: t_ids}", "++dsi.columns.weights={t: t_w}")
    # unpipelined: the ids' payloads are in the step
    plain = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "train.pipeline=false", *weighted[:-1]))
    cost = CostModel.from_config(round_cfg(TABLE, *OVERHEAD, "train.pipeline=false", *weighted))
    assert cost.id_weights and not plain.id_weights and cost.id_bytes == plain.id_bytes == 4
    assert cost.id_collectives == plain.id_collectives + 1
    shape = cost.shape(round_cfg(TABLE).model.tables[0], ShardingType.table_wise, 1)
    table = round_cfg(TABLE).model.tables[0]
    for pc in cost.piece_comms(table, ShardingType.table_wise, shape):
        assert cost.price(pc).total == approx(plain.price(pc).total * (2 if pc.carries is Carries.ids else 1))
    assert cost.ids_ms(table, ShardingType.table_wise, shape) == approx(IDS_WHOLE * A2A * 2)
