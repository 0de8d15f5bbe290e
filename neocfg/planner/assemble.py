"""Turn placements into the Plan contract: shard geometry per table, per-device estimates, step time, solver report."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

from neocfg.config.model import TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.plan import DeviceEstimate, Estimate, Plan, Shard, SolverReport, StepStrategies, TablePlan
from neocfg.planner.costs import CostModel, DenseCost, data_ms, dense_cost, planned_dense_sync, rider_bytes
from neocfg.perf import Perf
from neocfg.planner.hiding import Hiding, solver_overlaps
from neocfg.planner.strategies import resolve as resolve_strategies
from neocfg.planner.strategies import with_collectives
from neocfg.planner.types import Placement, SolveResult
from neocfg.sharding import SCHEMES, OutputKind, PieceShape
from neocfg.sharding.collectives import id_collectives
from neocfg.tiers import TIERS
from neocfg.types import IdsExchange


def shards_of(table: TableConfig, placement: Placement) -> tuple[Shard, ...]:
    """The sharding type's geometry (neocfg.sharding) over the placement's ranks, listed in rank order (CW/TWCW:
    slice i stays on ranks[i]; without fixed ranks ascending ranks get ascending column ranges)."""
    s, ranks = placement.option.sharding, placement.ranks
    if SCHEMES[s].sliced and placement.option.fixed_ranks is None:
        ranks = tuple(sorted(ranks))
    shards = SCHEMES[s].shards(table.num_embeddings, table.embedding_dim, ranks)
    return tuple(sorted(shards, key=lambda x: x.rank))


def device_perf(cost: CostModel, placements: Sequence[Placement]) -> list[Perf]:
    perf = [Perf() for _ in range(cost.topo.world)]
    for p in placements:
        for r in p.ranks:
            perf[r] = perf[r] + p.option.perf
    return perf


def assemble(cfg: NeocfgConfig, cost: CostModel, dense: DenseCost, result: SolveResult,
             strategies: StepStrategies | None = None) -> Plan:
    """The Plan of a solved placement (without DPP sizing, which dpp.size_dpp adds). Its step strategies are
    resolved here (planner/strategies.py; `strategies`: a given plan's own) and priced in the estimate: `dense` is
    the DDP-synced dense part the solver counted, re-priced without its all-reduce where the plan folds the dense
    gradients into the exchange; where the ids are exchanged in the prefetch thread, the id routing's host time
    moves from the embedding comm term to the data term (that thread shares a CPU rank's core: the total is the
    same). The solver report (objective, bound, gap) stays in the solver's terms: DDP-synced, routing in comm."""
    tables = cfg.model.tables
    placements = result.placements
    hbm = [0] * cost.topo.world
    host = [0] * cost.topo.world
    counts: list[Counter] = [Counter() for _ in range(cost.topo.world)]
    routed = [0.0] * cost.topo.world
    shapes = []
    for p in placements:
        o = p.option
        shape = cost.shape(tables[o.table_index], o.sharding, o.num_pieces if SCHEMES[o.sharding].sliced else 1)
        shapes.append(shape)
        ms = cost.routed_ms(o.sharding, shape)   # the same on every rank of the placement
        for r in p.ranks:
            hbm[r] += p.option.storage.hbm
            host[r] += p.option.storage.host
            counts[r][p.option.sharding.value] += 1
            routed[r] += ms
    table_plans = tuple(
        TablePlan(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                  sharding=p.option.sharding, memory=p.option.tier, weights_dtype=p.option.dtype,
                  shards=shards_of(t, p),
                  cache_ratio=cost.cache_ratio if TIERS[p.option.tier].hbm_cache else 0.0)
        for t, p in zip(tables, placements))
    hw = cfg.hardware
    plan = Plan(
        model_name=cfg.model.name, world_size=hw.num_devices, nodes=hw.nodes, devices_per_node=hw.devices_per_node,
        batch_size_per_device=cfg.train.batch_size, a2a_fwd_dtype=cfg.planner.a2a_fwd_dtype,
        a2a_bwd_dtype=cfg.planner.a2a_bwd_dtype, tables=table_plans, devices=(),
        estimate=Estimate(step_ms=0.0, samples_per_s=0.0), solver=SolverReport("", "", 0.0, 0.0, 0.0, 0.0), dpp=None)
    if strategies is None:   # (the bottom MLP's cover of this plan's exchange, from what is at hand: bottom_covers)
        covers = Hiding.priced(cost, dense.bottom, tables).covered(cost.topo, placements)
        strategies = resolve_strategies(cfg, plan, covers=covers)
    perf = device_perf(cost, placements)
    # Fixed per-step costs of the embedding part (collective latency, host kernels): the same on every device.
    kinds = {p.option.sharding for p in placements}
    groups: list[set] = [set() for _ in range(cost.topo.world)]
    for p in placements:
        for r in p.ranks:
            groups[r].add((p.option.dtype, p.option.tier))
    perf = [q + cost.embedding_overhead_ms(kinds, len(g)) for q, g in zip(perf, groups)]
    # the batch's generation where it shares the rank's core (CPU devices): the same on every device, every plan
    generation = data_ms(cfg)
    # The solver's objective and bound are in its own terms (every option priced with DDP's all-reduce and the
    # routing in comm; the fixed costs carried by fixed.py; what the bottom MLP hides of the outputs' all-to-all
    # where cfg's strategies overlap it, hiding.py): its bound holds for every plan of the enumerated options so
    # priced.
    solver_view = Hiding.of(cfg, cost, dense)
    solver_hidden = solver_view.device_hidden(cost.topo, placements)
    # The exchange's wait behind DDP's first bucket (CostModel.ddp_wait_step_ms) where, in the solvers' view, this
    # plan pays it: the solvers leave it out (whether a plan pays it turns on whether it overlaps), so it raises the
    # objective above what the bound bounds and shows in the gap.
    waits = cost.ddp_wait_step_ms(kinds, planned_dense_sync(cfg), solver_overlaps(cfg, cost, solver_view, placements))
    objective = (float(max(q.total - h for q, h in zip(perf, solver_hidden))) + waits + dense.perf.total
                 + generation)
    lb = result.lower_bound_ms + dense.perf.total + generation
    gap = (objective - lb) / objective if objective > 0 else 0.0
    # The estimate prices the strategies the plan runs.
    if strategies.dense_grad_sync is not planned_dense_sync(cfg):
        dense = dense_cost(cfg, strategies.dense_grad_sync)
        # the dense gradients ride in the backward all-to-all exactly when the plan's sync folds them
        riders = rider_bytes(cfg, strategies.dense_grad_sync)
        extra = dataclasses.replace(cost, rider_bytes=riders).rider_ms(kinds) - cost.rider_ms(kinds)
        perf = [dataclasses.replace(q, bwd_comm=q.bwd_comm + extra) for q in perf]
    data = [generation] * cost.topo.world
    # The id collectives the strategies issue in the step, exposed unless the ids travel behind the compute
    # (pipelined or prefetched: their bytes and latency leave the step); the solver priced cfg's ask (auto as in the
    # step).
    ahead = strategies.ids_exchange is IdsExchange.prefetch
    runs = dataclasses.replace(cost, ids_overlapped=ahead or strategies.pipeline,
                               id_collectives=id_collectives(strategies.pipeline, ahead, strategies.id_weights))
    if runs.exposed_id_collectives != cost.exposed_id_collectives:
        extra = (runs.exposed_id_collectives - cost.exposed_id_collectives) * cost.collective_latency_ms
        perf = [dataclasses.replace(q, fwd_comm=q.fwd_comm + extra) for q in perf]
    if runs.ids_overlapped != cost.ids_overlapped:
        ids = [0.0] * cost.topo.world
        for p, shape in zip(placements, shapes):
            table = tables[p.option.table_index]
            ms = runs.ids_ms(table, p.option.sharding, shape) - cost.ids_ms(table, p.option.sharding, shape)
            for r in p.ranks:
                ids[r] += ms
        perf = [dataclasses.replace(q, fwd_comm=q.fwd_comm + i) for q, i in zip(perf, ids)]
    if ahead:
        # the prefetch thread exchanges the ids a batch ahead on a group of its own: its collectives overlap the
        # step (none left in it), its routing shares the rank's core (data)
        moved = [x + cost.routing_ms_per_step for x in routed]
        perf = [dataclasses.replace(q, fwd_comm=q.fwd_comm - m) for q, m in zip(perf, moved)]
        data = [d + m for d, m in zip(data, moved)]
    hidden = [Perf()] * cost.topo.world
    if strategies.output_overlap:
        # the outputs' all-to-all travels behind the bottom MLP's forward, its gradients' behind its backward:
        # what the bottom MLP covers is counted once (in the dense term), the rest stays exposed in comm
        hidden = Hiding.priced(cost, dense.bottom, tables).per_device(cost.topo, placements)
        perf = [dataclasses.replace(q, fwd_comm=q.fwd_comm - h.fwd_comm, bwd_comm=q.bwd_comm - h.bwd_comm)
                for q, h in zip(perf, hidden)]
    # the output exchange's backward wait behind DDP's first bucket, where the plan waits for that exchange
    wait = cost.ddp_wait_step_ms(kinds, strategies.dense_grad_sync, strategies.output_overlap)
    perf = [dataclasses.replace(q, bwd_comm=q.bwd_comm + wait) for q in perf]
    devices = tuple(
        DeviceEstimate(rank=r, hbm_bytes=hbm[r] + dense.resident_bytes, host_bytes=host[r],
                       compute_ms=perf[r].compute + dense.perf.compute, comm_ms=perf[r].comm + dense.perf.comm,
                       total_ms=perf[r].total + dense.perf.total + data[r],
                       shard_counts=dict(sorted(counts[r].items())))
        for r in range(cost.topo.world))
    step = max(d.total_ms for d in devices)
    busiest = max(range(cost.topo.world), key=lambda r: devices[r].total_ms)
    plan = dataclasses.replace(
        plan, devices=devices,
        estimate=Estimate(step_ms=step, samples_per_s=cfg.train.batch_size * hw.num_devices / (step / 1e3),
                          dense_ms=dense.perf.total, dense_compute_ms=dense.perf.compute,
                          dense_comm_ms=dense.perf.comm, data_ms=data[busiest],
                          output_hidden_ms=hidden[busiest].comm),
        solver=SolverReport(algorithm=result.algorithm, status=result.status, seconds=result.seconds,
                            objective_ms=objective, lower_bound_ms=lb, gap=gap,
                            placement_source=result.placement_source.value),
        strategies=strategies)
    dp_update, dp_all_reduce = replica_backward_ms(cfg, plan, cost)
    return with_collectives(cfg, dataclasses.replace(plan, estimate=dataclasses.replace(
        plan.estimate, dp_update_ms=dp_update, dp_all_reduce_ms=dp_all_reduce)))


def replica_backward_ms(cfg: NeocfgConfig, plan: Plan, cost: CostModel | None = None) -> tuple[float, float]:
    """The data-parallel tables' backward on every device as the cost model prices it (what the runtime's
    dp_update and comm_dp laps measure): (their lookups' backward and replica_update_ms; their gradient all-reduce,
    bytes and its collective's latency). (0, 0) without data-parallel tables."""
    tables = [t for t in cfg.model.tables if SCHEMES[plan.table(t.name).sharding].kind is OutputKind.replicated]
    if not tables:
        return 0.0, 0.0
    cost = cost or CostModel.from_config(cfg)
    compute, comm = 0.0, cost.all_reduce_latency_ms
    for t in tables:
        tp = plan.table(t.name)
        shape = cost.shape(t, tp.sharding, 1)
        perf = cost.compute(t, shape, tp.memory, tp.weights_dtype) + cost.replica_update_ms(tp.sharding, shape)
        compute += perf.bwd_compute
        comm += cost.comm(t, tp.sharding, shape).bwd_comm
    return compute, comm
