"""The step's strategies (neocfg.plan.StepStrategies), resolved from config, hardware and the placement: what the
runtime runs and the plan says. Every `auto` is decided here, by the rules below, and nowhere in the runtime.

  ids_exchange      prefetch on CPU ranks whose data source has a prefetch thread (synthetic) when train.ids_exchange
                    says so, or is auto and some table is row-sharded (its routing, a bucketize of every row-sharded
                    id, is the heavy part); else step.
  pipeline          train.pipeline, when the ids are exchanged in the step (prefetched ids leave it nothing to do).
  dense_grad_sync   ddp, or exchange (the dense gradients in the embeddings' backward all-to-all): exchange when asked,
                    or under auto while world x the dense parameters' bytes <= DENSE_FOLD_MAX_BYTES; never without
                    an all-to-all output.
  output_overlap    the pooled outputs' all-to-all sent before the bottom MLP and waited for at the interaction (its
                    gradients' sent before the bottom MLP's backward): under overlap, or auto, where it can run:
                    the dense gradients synced by ddp (under exchange they ride in that backward all-to-all, which
                    then waits for the whole dense backward) and some pooled output coming back by all-to-all; on
                    CPU devices auto also needs the bottom MLP to cover the exchange (neocfg.planner.hiding's
                    bottom_covers: its copies run on the ranks' own cores, and what it cannot cover slows the step).
  prefetch_idle     the data source's prefetch thread at idle priority (SCHED_IDLE) where train.prefetch_priority
                    pins idle and the source has the thread; auto keeps the normal class: the estimate does not yet
                    price what an idle thread runs inside the step's waits (its CPU time leaves the comm laps, which
                    then read up to ~25 % below their price on generation-heavy table-wise models). Measured (2-core
                    Intel Xeon, whole runs, default stream, table-wise, interleaved against normal): tiny8 Zipf
                    128-131k against 108-117k samples/s, criteo Zipf 35.0-36.8k against 35.1-35.6k, the 856-table
                    model 1,810-1,904 against 1,793-1,816; row-wise tiny8 (ids exchanged in the thread) 78-84k
                    against 77-83k with data_wait 1.2-1.4 ms against 0.1.
  sums_by_all_to_all  the row-wise tables' partial sums sent by an all-to-all and summed on arrival instead of a
                    reduce-scatter: where train.partial_sums pins all_to_all, or is auto on CPU devices (gloo's
                    reduce_scatter on 2 ranks took 1.6-2.5x an all-to-all of it and the sum:
                    bench/bench_gloo_collectives.py); GPUs keep NCCL's reduce-scatter (a ring, and across nodes it
                    sends a node's share once where the all-to-all sends every rank's).
  id_dtype          int32 when every table's rows and every bag code (features of a rank x world x batch) fit.
  routing_encoding  lengths while the length entries per sample (row ranges x row-sharded tables) are at most
                    LENGTH_ENTRIES_PER_ID x the row-sharded ids per sample, else codes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from neocfg.config.model import ModelConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.errors import ConfigError
from neocfg.plan import Plan, StepStrategies
from neocfg.sharding import SCHEMES, OutputKind, Routing
from neocfg.sharding import has_all_to_all as tables_have_all_to_all
from neocfg.sharding import has_output_kind
from neocfg.sharding.collectives import ID32_LIMIT, LENGTH_ENTRIES_PER_ID, Collective, encoding_for, step_collectives
from neocfg.types import (DataSource, DenseGradSync, DeviceKind, IdDtype, IdsExchange, OutputOverlap, PartialSums,
                          PrefetchPriority, RoutingEncoding)

# DenseGradSync.auto folds the dense gradients into the embeddings' backward all-to-all when every rank's share of
# it (world x the dense parameters' bytes) is at most this. Measured (bench_vs_torchrec, 2 gloo ranks, one thread):
# tiny8's MLPs (9k parameters, 72 KB for 2 ranks) step faster folded than under DDP (one collective and DDP's
# hooks less); criteo's (475k parameters, 3.8 MB) stay with DDP, whose bucketed all-reduce overlaps their ~10 ms
# backward. Between the two is not measured; an all-to-all sends world x what a ring all-reduce sends, so the fold
# is for small dense parts.
DENSE_FOLD_MAX_BYTES = 1 << 20
FP32 = 4


def _row_sharded(plan: Plan) -> list[int]:
    return [i for i, t in enumerate(plan.tables) if SCHEMES[t.sharding].routing is Routing.by_row]


def has_all_to_all(plan: Plan) -> bool:
    """Some table's pooled outputs come back by the all-to-all (neocfg.sharding.has_all_to_all)."""
    return tables_have_all_to_all(plan.tables, plan.world_size, plan.devices_per_node)


def ids_exchange(mode: IdsExchange, plan: Plan, cpu_ranks: bool, source_prefetches: bool) -> IdsExchange:
    if not (cpu_ranks and source_prefetches) or mode is IdsExchange.step:
        return IdsExchange.step
    if mode is IdsExchange.auto:
        return IdsExchange.prefetch if _row_sharded(plan) else IdsExchange.step
    return IdsExchange.prefetch


def dense_grad_sync(sync: DenseGradSync, dense_params: int, world: int, all_to_all: bool) -> DenseGradSync:
    if sync is DenseGradSync.exchange and not all_to_all:
        raise ConfigError("train.dense_grad_sync", sync.value, "the plan exchanges no pooled output by all-to-all "
                          "(e.g. only row-wise or data-parallel tables); allowed here: auto, ddp")
    if sync is DenseGradSync.ddp or not all_to_all:
        return DenseGradSync.ddp
    if sync is DenseGradSync.exchange or world * dense_params * FP32 <= DENSE_FOLD_MAX_BYTES:
        return DenseGradSync.exchange
    return DenseGradSync.ddp


def output_overlap(mode: OutputOverlap, sync: DenseGradSync, all_to_all: bool) -> bool:
    """Whether the pooled outputs' all-to-all overlaps the bottom MLP (`sync`: the resolved dense-gradient sync)."""
    if mode is OutputOverlap.wait:
        return False
    if mode is OutputOverlap.overlap and not all_to_all:
        raise ConfigError("train.output_overlap", mode.value, "the plan exchanges no pooled output by all-to-all "
                          "(e.g. only row-wise or data-parallel tables); allowed here: auto, wait")
    if mode is OutputOverlap.overlap and sync is not DenseGradSync.ddp:
        raise ConfigError("train.output_overlap", mode.value, f"the dense gradients ride in the outputs' backward "
                          f"all-to-all (dense_grad_sync resolved to {sync.value}); allowed here: auto, wait, or "
                          f"overlap with train.dense_grad_sync=ddp")
    return all_to_all and sync is DenseGradSync.ddp


def prefetch_idle(mode: PrefetchPriority, source_prefetches: bool) -> bool:
    """Whether the data source's prefetch thread runs at idle priority (a source without it has nothing to set)."""
    return source_prefetches and mode is PrefetchPriority.idle


def sums_by_all_to_all(mode: PartialSums, cpu_ranks: bool, partial_sums: bool = True) -> bool:
    """Whether the row-wise partial sums travel by all-to-all (summed on arrival) rather than by reduce-scatter
    (partial_sums: some table's outputs are such sums; a plan without them has nothing to set)."""
    return partial_sums and (mode is PartialSums.all_to_all or (mode is PartialSums.auto and cpu_ranks))


def has_partial_sums(plan: Plan) -> bool:
    """Some table's pooled outputs are partial sums reduce-scattered over the world (row-wise on every rank)."""
    return has_output_kind(plan.tables, OutputKind.reduce_scatter, plan.world_size, plan.devices_per_node)


def id_dtype(plan: Plan, batch_size: int) -> IdDtype:
    """int32 when every table's rows and every bag code (a rank's looked-up features x world x batch) fit."""
    features = Counter(s.rank for t in plan.tables if SCHEMES[t.sharding].kind is not OutputKind.replicated
                       for s in t.shards)
    largest = max([*(t.num_embeddings for t in plan.tables), max(features.values(), default=0)
                   * plan.world_size * batch_size, 1])
    return IdDtype.int32 if largest < ID32_LIMIT else IdDtype.int64


def routing_encoding(plan: Plan, model: ModelConfig) -> RoutingEncoding:
    rw = _row_sharded(plan)
    if not rw:
        return RoutingEncoding.lengths
    pooling = {t.name: t.pooling_factor for t in model.tables}
    parts = max(len(plan.tables[i].shards) for i in rw)
    ids = sum(pooling[plan.tables[i].name] for i in rw)
    return encoding_for(parts * len(rw), ids)


def id_weights(cfg: NeocfgConfig) -> bool:
    """Per-id weights travel with the ids where a dataset maps weight columns (dsi.columns.weights)."""
    return bool(cfg.dsi.columns.weights) and cfg.dsi.source is not DataSource.synthetic


def resolve(cfg: NeocfgConfig, plan: Plan, source_prefetches: bool | None = None,
            covers: bool | None = None) -> StepStrategies:
    """The strategies cfg asks for, every auto decided, for this plan on cfg's hardware. source_prefetches: whether
    the batches come from a source with a prefetch thread (default: cfg's, the synthetic source has one); covers:
    whether the bottom MLP covers the plan's output exchange (hiding.bottom_covers; default: worked out here), where
    a caller that has the plan's cost model and placements already knows it."""
    tc = cfg.train
    if source_prefetches is None:
        source_prefetches = cfg.dsi.source is DataSource.synthetic
    exchange = ids_exchange(tc.ids_exchange, plan, cfg.hardware.device.kind is DeviceKind.cpu, source_prefetches)
    from neocfg.planner.costs import dense_flops_and_params   # (costs reads this module's rules)

    dense_params = dense_flops_and_params(cfg.model)[1]
    all_to_all = has_all_to_all(plan)
    sync = dense_grad_sync(tc.dense_grad_sync, dense_params, plan.world_size, all_to_all)
    overlap = output_overlap(tc.output_overlap, sync, all_to_all)
    if overlap:
        from neocfg.planner.hiding import auto_covers_only, bottom_covers

        if auto_covers_only(cfg):
            overlap = bottom_covers(cfg, plan) if covers is None else covers
    return StepStrategies(
        pipeline=tc.pipeline and exchange is IdsExchange.step, ids_exchange=exchange, dense_grad_sync=sync,
        id_dtype=id_dtype(plan, tc.batch_size), routing_encoding=routing_encoding(plan, cfg.model),
        id_weights=id_weights(cfg), output_overlap=overlap,
        prefetch_idle=prefetch_idle(tc.prefetch_priority, source_prefetches),
        sums_by_all_to_all=sums_by_all_to_all(tc.partial_sums, cfg.hardware.device.kind is DeviceKind.cpu,
                                              has_partial_sums(plan)))


def with_strategies(cfg: NeocfgConfig, plan: Plan, source_prefetches: bool | None = None) -> Plan:
    """The plan with its strategies resolved for cfg (those it carries are kept: pinned by a plan file) and the
    collectives they make a step issue."""
    if plan.strategies is None:
        plan = dataclasses.replace(plan, strategies=resolve(cfg, plan, source_prefetches))
    return with_collectives(cfg, plan)


def with_collectives(cfg: NeocfgConfig, plan: Plan) -> Plan:
    """The plan with Plan.collectives derived from its strategies (a plan file's own list is never trusted)."""
    return dataclasses.replace(plan, collectives=plan_collectives(cfg, plan))


def plan_collectives(cfg: NeocfgConfig, plan: Plan) -> tuple[tuple[Collective, ...], ...]:
    """Every rank's collectives per step of this plan run with cfg's model (its strategies resolved if it has none):
    the list the planner prices and the runtime issues (neocfg.sharding.collectives.step_collectives)."""
    from neocfg.planner.costs import dense_flops_and_params

    if plan.strategies is None:
        plan = dataclasses.replace(plan, strategies=resolve(cfg, plan))
    return step_collectives(plan, cfg.model, dense_flops_and_params(cfg.model)[1], cfg.planner.costs.ddp_bucket_mib)
