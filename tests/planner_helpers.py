"""Shared helpers of the planner tests: small configs with round numbers, brute force, plan checks."""

from __future__ import annotations

import itertools
from typing import Sequence

from neocfg.plan import Plan
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, ShardingOption, Spread, Topology
from neocfg.types import DeviceKind, MemoryTier, ShardingType, WeightsDtype

from conftest import compose_cfg

# A cluster with round numbers: 2 nodes x 4 devices, every efficiency 1, no per-shard, per-kernel, per-collective
# or activation-pass overhead (tests/test_planner_costs.py checks those terms on their own).
ROUND_HW = ["hardware=zionex_2node", "hardware.devices_per_node=4", "hardware.intra_node_bandwidth_gbs=100",
            "hardware.inter_node_bandwidth_gbs=10", "hardware.device.hbm_bandwidth_gbs=1000",
            "hardware.host.pcie_bandwidth_gbs=10", "train.batch_size=100", "planner.costs.hbm_efficiency=1",
            "planner.costs.pcie_efficiency=1", "planner.costs.comm_efficiency=1", "planner.costs.shard_overhead_us=0",
            "hardware.collective_latency_us=0", "hardware.device.kernel_overhead_us=0",
            "planner.costs.dense_activation_passes=0"]


def tables_override(rows: Sequence[tuple[str, int, int, float]]) -> str:
    items = ",".join(f"{{name:{n},num_embeddings:{r},embedding_dim:{d},pooling_factor:{p},zipf_alpha:1.0}}"
                     for n, r, d, p in rows)
    return f"model.tables=[{items}]"


def round_cfg(rows: Sequence[tuple[str, int, int, float]], *extra: str):
    return compose_cfg(ROUND_HW + [tables_override(rows), "model.interaction=dcn", "model.bottom_mlp=[8]",
                                   "model.top_mlp=[4,1]", "model.num_dense_features=4", *extra])


def placements_of(topo: Topology, o: ShardingOption) -> list[tuple[int, ...]]:
    """Every distinct way to put an option's pieces on devices (slices are identical, so sets of devices)."""
    if o.fixed_ranks is not None:
        return [o.fixed_ranks]
    if o.spread is Spread.world:
        return [tuple(range(topo.world))]
    if o.spread is Spread.node:
        return [topo.node_ranks(n) for n in range(topo.nodes)]
    if o.spread is Spread.node_distinct:
        return [c for n in range(topo.nodes) for c in itertools.combinations(topo.node_ranks(n), o.num_pieces)]
    return list(itertools.combinations(range(topo.world), o.num_pieces))


def brute_force_makespan(topo: Topology, capacity, options: Sequence[Sequence[ShardingOption]]) -> float:
    """The least busiest-device time over every option choice and placement that fits memory."""
    per_table = [[Placement(o, r) for o in opts for r in placements_of(topo, o)] for opts in options]
    best = float("inf")
    for combo in itertools.product(*per_table):
        loads = DeviceLoads.of(topo, capacity, combo)
        if loads.over_capacity() is None:
            best = min(best, float(loads.time.max()))
    return best


def check_plan_contract(plan: Plan, hbm_capacity: int | None = None) -> None:
    """Shard geometry the runtime relies on, and memory per device."""
    w, p = plan.world_size, plan.devices_per_node
    assert w == plan.nodes * p and len(plan.devices) == w
    for t in plan.tables:
        ranks = [s.rank for s in t.shards]
        assert ranks == sorted(ranks), t.name
        assert all(0 <= r < w for r in ranks)
        kind = t.sharding.value
        if kind in ("row_wise", "table_row_wise"):
            assert len(ranks) == (w if kind == "row_wise" else p)
            if kind == "table_row_wise":
                assert len({r // p for r in ranks}) == 1
            off = 0
            for s in t.shards:
                assert s.row_offset == off and s.num_rows > 0 and s.col_offset == 0 and s.num_cols == t.embedding_dim
                off += s.num_rows
            assert off == t.num_embeddings
        elif kind in ("column_wise", "table_column_wise"):
            assert len(set(ranks)) == len(ranks) >= 2
            if kind == "table_column_wise":
                assert len({r // p for r in ranks}) == 1
            cols = sorted((s.col_offset, s.num_cols) for s in t.shards)
            off = 0
            for c0, nc in cols:
                assert c0 == off and nc % 4 == 0 and nc >= 4
                off += nc
            assert off == t.embedding_dim
            assert all(s.row_offset == 0 and s.num_rows == t.num_embeddings for s in t.shards)
        elif kind == "data_parallel":
            assert ranks == list(range(w))
            assert all(s.num_rows == t.num_embeddings and s.num_cols == t.embedding_dim for s in t.shards)
        else:
            assert len(ranks) == 1
            s = t.shards[0]
            assert (s.row_offset, s.num_rows, s.col_offset, s.num_cols) == (0, t.num_embeddings, 0, t.embedding_dim)
    if hbm_capacity is not None:
        assert all(d.hbm_bytes <= hbm_capacity for d in plan.devices)
    assert plan.solver.lower_bound_ms <= plan.solver.objective_ms + 1e-9
    assert abs(plan.estimate.step_ms - max(d.total_ms for d in plan.devices)) < 1e-9


def hidden_by_estimate(cfg, cost, placements: Sequence[Placement]) -> list[float]:
    """Per device, what the estimate should take off for the bottom MLP's cover of the outputs' all-to-all where the
    plan's strategies overlap it (the strategies' rules on the plan's output kinds), written out here from the
    documented rule, independent of neocfg.planner.hiding: each way, min(efficiency x (one collective's latency + the
    device's pieces' output wire time), the bottom MLP's compute that way); under auto on a CPU device, all of it
    where the bottom MLP covers that on every device, each way, else nothing (the plan waits)."""
    from neocfg.planner.costs import dense_cost, dense_flops_and_params
    from neocfg.planner.strategies import dense_grad_sync, output_overlap
    from neocfg.sharding import SCHEMES, OutputKind

    topo = cost.topo
    a2a = any(SCHEMES[p.option.sharding].output_kind(p.ranks, topo.world, topo.devices_per_node)
              is OutputKind.all_to_all for p in placements)
    sync = dense_grad_sync(cfg.train.dense_grad_sync, dense_flops_and_params(cfg.model)[1], topo.world, a2a)
    if not output_overlap(cfg.train.output_overlap, sync, a2a):
        return [0.0] * topo.world
    tables = cfg.model.tables
    shapes = [cost.shape(tables[p.option.table_index], p.option.sharding,
                         p.option.num_pieces if SCHEMES[p.option.sharding].sliced else 1) for p in placements]
    wire = [[0.0, 0.0] for _ in range(topo.world)]
    for p, shape in zip(placements, shapes):
        fwd, bwd = cost.output_wire_ms(tables[p.option.table_index], p.option.sharding, shape)
        for r in p.ranks:
            wire[r][0] += fwd
            wire[r][1] += bwd
    bottom, eff, alpha = dense_cost(cfg).bottom, cost.output_overlap_efficiency, cost.collective_latency_ms
    if cfg.train.output_overlap.value == "auto" and cfg.hardware.device.kind.value == "cpu" and not all(
            eff * (alpha + f) <= bottom.fwd_compute and eff * (alpha + b) <= bottom.bwd_compute for f, b in wire):
        return [0.0] * topo.world
    return [min(eff * (alpha + f), bottom.fwd_compute) + min(eff * (alpha + b), bottom.bwd_compute)
            for f, b in wire]


def step_by_cost_model(cost, dense_ms: float, placements: Sequence[Placement], cfg=None) -> float:
    """A plan's step time straight from the cost model (what assemble reports), independent of the solvers' view:
    each device's pieces plus CostModel.embedding_overhead_ms for the plan's kinds and its lookup groups; with cfg,
    less what the bottom MLP hides under the plan's output_overlap (hidden_by_estimate)."""
    loads = DeviceLoads.of(cost.topo, cost.capacity, placements)
    kinds = {p.option.sharding for p in placements}
    groups: list[set] = [set() for _ in range(cost.topo.world)]
    for p in placements:
        for r in p.ranks:
            groups[r].add((p.option.dtype, p.option.tier))
    hidden = hidden_by_estimate(cfg, cost, placements) if cfg is not None else [0.0] * cost.topo.world
    return dense_ms + max(float(loads.time[d]) + cost.embedding_overhead_ms(kinds, len(groups[d])).total - hidden[d]
                          for d in range(cost.topo.world))


def all_plans(topo: Topology, options: Sequence[Sequence[ShardingOption]]):
    """Every plan: one option and one placement of it per table (memory not checked)."""
    per_table = [[Placement(o, r) for o in opts for r in placements_of(topo, o)] for opts in options]
    return itertools.product(*per_table)


def count_plans(topo: Topology, options: Sequence[Sequence[ShardingOption]]) -> int:
    n = 1
    for opts in options:
        n *= sum(len(placements_of(topo, o)) for o in opts)
    return n


def brute_force_step(cost, dense_ms: float, options: Sequence[Sequence[ShardingOption]], cfg=None) -> float:
    """The least step time (cost model, fixed costs included; with cfg, less what the bottom MLP hides) over every
    plan that fits memory."""
    best = float("inf")
    for combo in all_plans(cost.topo, options):
        if DeviceLoads.of(cost.topo, cost.capacity, combo).over_capacity() is None:
            best = min(best, step_by_cost_model(cost, dense_ms, combo, cfg))
    return best


def unpruned_options(cfg, cost) -> list[list[ShardingOption]]:
    """Every option the planner enumerates, none dropped as dominated, written from the rules as documented (not
    from neocfg.planner.options): each allowed sharding type x memory tier x weight precision whose piece fits an
    empty device; column slice counts k >= 2 that are powers of two or the limit (the world for column-wise, a node
    for table-column-wise, at most planner.max_column_slices) with slices of a multiple of 4 columns; row-wise and
    table-row-wise when every rank gets a row; data-parallel replicas in HBM at fp32 only (the runtime keeps them
    so). For tables without forced ranks."""
    hw, pl = cfg.hardware, cfg.planner
    world, per_node = hw.num_devices, hw.devices_per_node
    out = []
    for index, t in enumerate(cfg.model.tables):
        assert t.ranks is None
        kinds = [s for s in pl.sharding_types if t.sharding_types is None or s in t.sharding_types]
        tiers = [m for m in pl.memory_tiers if t.memory_tiers is None or m in t.memory_tiers]
        if hw.device.kind is DeviceKind.cpu:
            tiers = [m for m in tiers if m is MemoryTier.hbm]
        dtypes = [d for d in pl.weights_dtypes if t.weights_dtypes is None or d in t.weights_dtypes]
        opts = []
        for s in kinds:
            if s in (ShardingType.column_wise, ShardingType.table_column_wise):
                limit = min(world if s is ShardingType.column_wise else per_node, pl.max_column_slices)
                shapes = [(k, k) for k in range(2, limit + 1) if (k & (k - 1) == 0 or k == limit)
                          and t.embedding_dim % k == 0 and (t.embedding_dim // k) % 4 == 0]
            elif s is ShardingType.table_wise:
                shapes = [(1, 1)]
            else:
                ranks = per_node if s is ShardingType.table_row_wise else world
                if s is not ShardingType.data_parallel and not (ranks >= 2 and t.num_embeddings
                                                                > (ranks - 1) * -(-t.num_embeddings // ranks)):
                    continue
                shapes = [(1, ranks)]
            for k, pieces in shapes:
                for m in tiers:
                    for d in dtypes:
                        if s is ShardingType.data_parallel and (m is not MemoryTier.hbm or d is not WeightsDtype.fp32):
                            continue
                        perf, storage = cost.piece(t, s, m, d, k)
                        if storage.fits(cost.capacity):
                            opts.append(ShardingOption(index, s, m, d, pieces, perf, storage))
        out.append(opts)
    return out
