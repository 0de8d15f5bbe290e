"""neocfg's planner inside TorchRec: a drop-in for `EmbeddingShardingPlanner`, and plan converters both ways.

    planner = NeocfgShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), batch_size=512,
                                    constraints={"t0": ParameterConstraints(pooling_factors=[3.0])})
    plan = planner.plan(model, sharders)            # a torchrec ShardingPlan, as EmbeddingShardingPlanner returns
    model = DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)

plan() runs TorchRec's own steps around neocfg's solver: the storage reservation measures the module's dense part
and KJT buffers and takes them off each device; the enumerator lists each table's options (sharding type x compute
kernel x column split), bounded by the sharders' sharding_types() / compute_kernels() and the constraints. Those
options become a neocfg model (sharding types, memory tiers, column slice counts, the table's dtype, its pooling);
the hardware is TorchRec's Topology (node layout, each rank's own memory after the reservation; bandwidths on
CUDA only, where TorchRec's figures describe a GPU: on CPU the preset's calibrated figures stay). neocfg solves it and
each table's chosen option, its shards on neocfg's ranks, goes through TorchRec's callbacks, stats and
to_sharding_plan, so the constraints' fused parameters (cache params, enforce_hbm, stochastic rounding, bounds check
mode, output dtype) reach the ParameterSharding. Failures are TorchRec's PlannerError with its PlannerErrorType.

TorchRec is an optional dependency: importing this module without it raises an ImportError that says so."""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

try:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed._shard.metadata import ShardMetadata
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.planner.constants import BATCH_SIZE
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
    from torchrec.distributed.planner.planners import extract_plan, to_sharding_plan as options_to_sharding_plan
    from torchrec.distributed.planner.stats import EmbeddingStats
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import (Enumerator, ParameterConstraints, PlanLoader, PlannerError,
                                                    PlannerErrorType, ShardingOption, Stats, Storage,
                                                    StorageReservation, Topology, hash_planner_context_inputs,
                                                    hash_planner_context_inputs_str)
    from torchrec.distributed.sharding_plan import get_default_sharders, placement
    from torchrec.distributed.utils import get_device_type
    from torchrec.distributed.types import (EmbeddingModuleShardingPlan, EnumerableShardingSpec, ModuleSharder,
                                            ParameterSharding, ShardingPlan)
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
except ImportError as exc:  # pragma: no cover - exercised where TorchRec is absent
    raise ImportError(f"neocfg.interop.torchrec needs TorchRec ({exc}); install it (`make torchrec-env` builds "
                      f".venv-torchrec) or use neocfg.interop.export, which writes TorchRec plans without it") from exc

from neocfg.config.model import ModelConfig, TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.errors import ConfigError, InfeasibleError
from neocfg.interop.export import (DATA_PARALLEL_KERNEL, KERNEL_OF_TIER, TIER_OF_KERNEL, compute_device_of,
                                   compute_kernel, read_torchrec_dict, table_entry, table_plan_of, to_torchrec_dict,
                                   unrated_plan)
from neocfg.plan import GIVEN_PLAN_ALGORITHM, Plan, TablePlan
from neocfg.planner.costs import CostModel
from neocfg.planner.types import Perf as NeoPerf, Storage as NeoStorage
from neocfg.sharding import SCHEMES, Routing
from neocfg.types import Interaction, MemoryTier, ShardingType, WeightsDtype

GIB = 1024**3
# TorchRec's Topology bandwidths are bytes per millisecond; neocfg's hardware presets use GB/s (1e9 bytes/s).
_BYTES_PER_MS_TO_GBS = 1e3 / 1e9
# TorchRec's default pooling factor per feature when the constraints give none (planner/constants.py POOLING_FACTOR).
TORCHREC_DEFAULT_POOLING = 1.0
# The hardware preset a Topology starts from (its calibrated kernel and collective overheads): per compute device.
DEFAULT_PRESET = {"cpu": "cpu_local", "cuda": "zionex_1node"}
# EmbeddingShardingPlanner's default storage reservation: HeuristicalStorageReservation's percentage (planners.py
# heuristical_storage_reservation_percentage).
HEURISTICAL_RESERVATION = 0.15
# TorchRec table data types neocfg plans, and their neocfg weight dtype.
_DTYPE_OF = {DataType.FP32: WeightsDtype.fp32, DataType.FP16: WeightsDtype.fp16}
# What the ILP minimizes per piece: TorchRec's shard perf estimates (what its planner minimizes) or neocfg's cost model.
ESTIMATORS = ("torchrec", "neocfg")
# The ILP's relative gap under TorchRec's estimator: its shard perf is microseconds against neocfg's dense estimate of
# about a millisecond in the same objective, so planner.mip_gap's 1 % would leave the embedding part ~10 % off.
TORCHREC_ESTIMATOR_MIP_GAP = 1e-4
_SLICED = (ShardingType.column_wise.value, ShardingType.table_column_wise.value)
_ROW_SHARDED = tuple(s.value for s, scheme in SCHEMES.items() if scheme.routing is Routing.by_row)


@dataclass(frozen=True)
class FoundTable:
    path: str                    # module path of the embedding collection holding the table ("" for the root)
    config: EmbeddingBagConfig
    sharder: ModuleSharder


def find_tables(module: nn.Module, sharders: Sequence[ModuleSharder]) -> list[FoundTable]:
    """Every shardable table of every module a sharder handles, with its module path."""
    by_type = {s.module_type: s for s in sharders}
    found: list[FoundTable] = []
    for path, child in module.named_modules():
        sharder = by_type.get(type(child))
        if sharder is None:
            continue
        configs = child.embedding_bag_configs() if hasattr(child, "embedding_bag_configs") else \
            child.embedding_configs()
        shardable = set(sharder.shardable_parameters(child))
        found += [FoundTable(path, c, sharder) for c in configs if c.name in shardable]
    names = [f.config.name for f in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError("module", dup[0], "table names must be unique across the module's embedding collections")
    if not found:
        raise ConfigError("module", type(module).__name__,
                          f"has no tables the sharders handle ({', '.join(s.module_type.__name__ for s in sharders)})")
    return found


# ---- TorchRec's inputs, read or refused ---------------------------------------------------------------------
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One warning per process for each input neocfg accepts but gives no meaning."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _refuse(table: str, field: str, value: Any, why: str,
            kind: PlannerErrorType = PlannerErrorType.STRICT_CONSTRAINTS) -> PlannerError:
    return PlannerError(f"table {table}: ParameterConstraints.{field}={value!r} {why}", kind)


def _check_table(t: EmbeddingBagConfig, c: Optional[ParameterConstraints], compute_device: str) -> None:
    """Refuse, naming the table and the field, what neocfg cannot plan (a device group other than the topology's
    compute device, weight types other than fp32 and fp16). Virtual / key-value tables are planned in their own
    kernels with TorchRec's figures (stand_in_kernels)."""
    if c is not None and c.device_group is not None and c.device_group != compute_device:
        raise _refuse(t.name, "device_group", c.device_group,
                      f"differs from the topology's compute device {compute_device!r}; neocfg plans one device kind")
    if t.data_type not in _DTYPE_OF:
        raise PlannerError(f"table {t.name}: data_type={t.data_type.name} is not planned by neocfg (allowed: "
                           f"{', '.join(d.name for d in _DTYPE_OF)})", PlannerErrorType.STRICT_CONSTRAINTS)


def _pooling(t: EmbeddingBagConfig, c: Optional[ParameterConstraints], batch: int) -> float:
    """Ids looked up per sample: each feature's pooling factor x its poolings x its batch size over the planner's
    (TorchRec's per-feature num_poolings and batch_sizes), summed; TorchRec's default 1 per feature without them."""
    features = max(1, len(t.feature_names))
    if c is None or not c.pooling_factors:
        return TORCHREC_DEFAULT_POOLING * features
    n = len(c.pooling_factors)
    poolings = c.num_poolings or [1.0] * n
    batches = c.batch_sizes or [batch] * n
    for field, values in (("num_poolings", poolings), ("batch_sizes", batches)):
        if len(values) != n:
            raise _refuse(t.name, field, values, f"has {len(values)} entries; pooling_factors has {n}",
                          PlannerErrorType.INPUT_VALIDATION)
    return float(sum(p * k * b / batch for p, k, b in zip(c.pooling_factors, poolings, batches)))


def _table_config(t: EmbeddingBagConfig, c: Optional[ParameterConstraints], options: Sequence[ShardingOption],
                  batch: int, real_kernel: Mapping[tuple[str, str], str]) -> TableConfig:
    """The neocfg table of one module table: its pooling, and the sharding types, memory tiers and column slice
    counts of TorchRec's enumerated options for it (which already honour the sharders and the constraints;
    real_kernel: StandIns')."""
    known = {m.value for m in ShardingType}
    usable = [o for o in options if o.sharding_type in known and
              (o.compute_kernel in TIER_OF_KERNEL or o.compute_kernel == DATA_PARALLEL_KERNEL)
              # the constraints again, for an enumerator given without them
              and (c is None or not c.sharding_types or o.sharding_type in c.sharding_types)
              and (c is None or not c.compute_kernels
                   or real_kernel.get((t.name, o.compute_kernel), o.compute_kernel) in c.compute_kernels)]
    if not usable:
        pairs = sorted({(o.sharding_type, o.compute_kernel) for o in options})
        raise PlannerError(f"table {t.name}: none of its allowed (sharding type, compute kernel) pairs {pairs} is "
                           f"planned by neocfg (sharding types: {', '.join(sorted(known))}; compute kernels: "
                           f"{', '.join([DATA_PARALLEL_KERNEL, *TIER_OF_KERNEL])}); check "
                           f"ParameterConstraints.sharding_types / compute_kernels and the sharder's",
                           PlannerErrorType.STRICT_CONSTRAINTS)
    shardings = [s for s in ShardingType if s.value in {o.sharding_type for o in usable}]
    tiers = sorted({TIER_OF_KERNEL[o.compute_kernel] for o in usable if o.compute_kernel in TIER_OF_KERNEL},
                   key=lambda m: m.value) or [MemoryTier.hbm]
    slices = sorted({len(o.shards) for o in usable if o.sharding_type in _SLICED})
    rows = min(t.num_embeddings, STAND_IN_MAX_ROWS) if any((t.name, o.compute_kernel) in real_kernel
                                                           for o in usable) else t.num_embeddings
    # TorchRec row-shards a table of fewer rows than shards too (block bucketization leaves the last shards empty);
    # neocfg's pieces need a row each: its model holds one per shard (storage and the returned shards are TorchRec's)
    rows = max([rows, *(len(o.shards) for o in usable if o.sharding_type in _ROW_SHARDED)])
    return TableConfig(name=t.name, num_embeddings=rows, embedding_dim=t.embedding_dim,
                       pooling_factor=_pooling(t, c, batch), sharding_types=shardings, memory_tiers=tiers,
                       weights_dtypes=[_DTYPE_OF[t.data_type]], column_slices=slices or None)


def model_config(found: Sequence[FoundTable], constraints: Mapping[str, ParameterConstraints],
                 search_space: Sequence[ShardingOption], batch: int, name: str,
                 real_kernel: Mapping[tuple[str, str], str] = {}) -> ModelConfig:
    """The neocfg model of the module's tables. Its dense MLPs only shape the dense estimate, which is the same for
    every plan; their memory is not counted (planner.dense_resident_bytes=0): the storage reservation measured the
    module's own dense part. DCN when the tables' dims differ (dot needs one)."""
    by_name: dict[str, list[ShardingOption]] = {}
    for o in search_space:
        by_name.setdefault(o.name, []).append(o)
    tables = [_table_config(f.config, constraints.get(f.config.name), by_name.get(f.config.name, []), batch,
                            real_kernel) for f in found if f.config.name in by_name]
    dims = {t.embedding_dim for t in tables}
    model = ModelConfig(name=name, tables=tables, interaction=Interaction.dot if len(dims) == 1 else Interaction.dcn)
    model.check("model")
    return model


def topology_overrides(topology: Topology, reserved: Optional[Topology] = None) -> list[str]:
    """neocfg hardware overrides of a TorchRec Topology: nodes from local_world_size; device memory the largest
    device's after the storage reservation (`reserved`, the topology reserve() returned; rank_capacity gives each
    rank its own where they differ); bandwidths on CUDA only."""
    local = topology.local_world_size
    if topology.world_size % local:
        raise PlannerError(f"topology: world_size {topology.world_size} must be a multiple of local_world_size "
                           f"{local}", PlannerErrorType.INPUT_VALIDATION)
    devices = (reserved or topology).devices
    hbm = max(d.storage.hbm for d in devices)
    ddr = max(d.storage.ddr for d in devices)
    out = [f"hardware.name=torchrec_{topology.compute_device}_{topology.world_size}",
           f"hardware.nodes={topology.world_size // local}", f"hardware.devices_per_node={local}"]
    if reserved is not None:   # the reservation took its share: neocfg keeps none back
        out += ["planner.costs.hbm_reserve_fraction=0", "planner.costs.host_reserve_fraction=0"]
    if topology.compute_device == "cpu":
        return out + [f"hardware.device.hbm_gib={max(ddr, hbm, 1) / GIB!r}"]
    bw = _BYTES_PER_MS_TO_GBS
    out += [f"hardware.device.hbm_gib={max(hbm, 1) / GIB!r}", f"hardware.host.ddr_gib={max(ddr, 1) * local / GIB!r}",
            f"hardware.device.hbm_bandwidth_gbs={topology.hbm_mem_bw * bw}",
            f"hardware.host.pcie_bandwidth_gbs={topology.hbm_to_ddr_mem_bw * bw}",
            f"hardware.intra_node_bandwidth_gbs={topology.intra_host_bw * bw}",
            f"hardware.inter_node_bandwidth_gbs={topology.inter_host_bw * bw}"]
    if ddr == 0:   # no device has host memory: no UVM tier
        out.append("planner.memory_tiers=[hbm]")
    return out


def rank_capacity(reserved: Topology, cost: CostModel) -> tuple[NeoStorage, ...]:
    """Each rank's memory after the storage reservation, where the devices differ (() where they are alike: the
    cost model's capacity is every rank's). On CPU TorchRec's device memory is DDR, neocfg's the rank's own."""
    if reserved.compute_device == "cpu":
        per = [NeoStorage(max(d.storage.ddr, d.storage.hbm, 1), cost.host_capacity) for d in reserved.devices]
    else:
        per = [NeoStorage(max(d.storage.hbm, 1), d.storage.ddr) for d in reserved.devices]
    return tuple(per) if len(set(per)) > 1 else ()


def compose_config(overrides: Sequence[str]) -> NeocfgConfig:
    """conf/ composed as the CLI does (mode=plan), then typed and checked. Works inside a Hydra app too (a TorchRec
    training script with its own @hydra.main): its global Hydra state is set aside and restored."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from neocfg.config import CONF_DIR
    from neocfg.config.schema import load, register

    register()
    outer = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            raw = compose("config", overrides=["mode=plan", *overrides])
    finally:
        GlobalHydra.instance().clear()
        if outer is not None:
            GlobalHydra.instance().initialize(outer)
    return load(raw)


def _topology_of_preset(hardware: str) -> Topology:
    """A TorchRec Topology of a neocfg hardware preset (world, node layout, per-device memory)."""
    hw = compose_config([f"hardware={hardware}"]).hardware
    device = compute_device_of(hw.device.kind)
    hbm = int(hw.device.hbm_gib * GIB)
    ddr = int(hw.host.ddr_gib * GIB / hw.devices_per_node)
    return Topology(world_size=hw.num_devices, local_world_size=hw.devices_per_node, compute_device=device,
                    hbm_cap=0 if device == "cpu" else hbm, ddr_cap=hbm if device == "cpu" else ddr)


def _default_topology() -> Topology:
    """TorchRec's default: the initialized process group's world, on this process's device type."""
    if not dist.is_initialized():
        raise PlannerError("topology: none given and no process group is initialized to take the world from; pass "
                           "topology=Topology(...) or hardware=<neocfg preset>", PlannerErrorType.INPUT_VALIDATION)
    return Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(),
                    compute_device=get_device_type())


def _storage_failure(search_space: Sequence[ShardingOption], reserved: Topology) -> bool:
    """No plan can fit the world's memory left after the reservation: the tables' smallest options, summed tier by
    tier (each tier's own smallest: a lower bound of any plan's need), exceed it. Else a failed plan failed because
    of the constraints (TorchRec's two PlannerErrorTypes)."""
    least: dict[str, tuple[int, int]] = {}
    for o in search_space:
        total = sum((s.storage for s in o.shards if s.storage is not None), Storage(0, 0))
        hbm, ddr = least.get(o.name, (total.hbm, total.ddr))
        least[o.name] = (min(hbm, total.hbm), min(ddr, total.ddr))
    have = sum((d.storage for d in reserved.devices), Storage(0, 0))
    return sum(h for h, _ in least.values()) > have.hbm or sum(d for _, d in least.values()) > have.ddr


# The tiers a kernel neocfg does not model (key-value and virtual-table kernels, customized kernels) stands in for, in
# order: each such kernel of a table takes one, so that the table's options stay distinct in neocfg's model.
STAND_IN_TIERS = tuple(MemoryTier)
# A stand-in table's rows in neocfg's model: its storage and perf are TorchRec's and its shards TorchRec's option's,
# so neocfg's rows only shape the pieces; a virtual table's id space (up to 2^60) is capped where neocfg's size check
# would take it for a typo (2^30 rows of 64 fp16 columns: 128 GiB, within any topology's 1,024 nodes).
STAND_IN_MAX_ROWS = 2**30


@dataclass(frozen=True)
class StandIns:
    """The search space with every option neocfg cannot model relabelled to a stand-in kernel (a table whose options
    all use kernels outside neocfg's tiers: virtual / key-value tables). Such options are priced by TorchRec's
    estimators whatever the estimator (neocfg has no model of them) and get their own kernel back when chosen."""

    options: list[ShardingOption]
    real_kernel: dict[tuple[str, str], str]   # (table, stand-in kernel) -> the option's own kernel

    @property
    def tables(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.real_kernel)

    def restore(self, option: ShardingOption) -> ShardingOption:
        option.compute_kernel = self.real_kernel.get((option.name, option.compute_kernel), option.compute_kernel)
        return option


def stand_in_kernels(search_space: Sequence[ShardingOption]) -> StandIns:
    modelled = {*TIER_OF_KERNEL, DATA_PARALLEL_KERNEL}
    kernels: dict[str, set[str]] = {}
    for o in search_space:
        kernels.setdefault(o.name, set()).add(o.compute_kernel)
    stand_in: dict[tuple[str, str], str] = {}
    for name, ks in kernels.items():
        if ks & modelled:   # the table has options neocfg models: those are its options (_table_config)
            continue
        if len(ks) > len(STAND_IN_TIERS):
            raise PlannerError(f"table {name}: {len(ks)} compute kernels neocfg does not model ({', '.join(sorted(ks))}"
                               f"); it plans at most {len(STAND_IN_TIERS)} of them per table: narrow "
                               f"ParameterConstraints.compute_kernels", PlannerErrorType.STRICT_CONSTRAINTS)
        stand_in.update({(name, k): KERNEL_OF_TIER[tier] for k, tier in zip(sorted(ks), STAND_IN_TIERS)})
    options = []
    for o in search_space:
        kernel = stand_in.get((o.name, o.compute_kernel))
        if kernel is not None:
            o = copy.copy(o)
            o.compute_kernel = kernel
        options.append(o)
    return StandIns(options, {(name, v): k for (name, k), v in stand_in.items()})


# neocfg's per-step fixed costs (collective latencies, kernel launches, id routing, each TBE call's fixed time) and
# what the bottom MLP hides of the outputs' all-to-all (output_overlap), absent from TorchRec's rating.
_FIXED_TERMS = ("collective_latency_ms", "reduce_scatter_latency_ms", "all_reduce_latency_ms", "kernel_overhead_ms",
                "routing_ms_per_step", "routing_ms_per_id", "tbe_ms_per_group", "rider_bytes",
                "ddp_wait_ms", "output_overlap_efficiency")
_Key = tuple[str, str, str, int]   # table, sharding type, compute kernel, column slices (0 when not sliced)


def _key(table: str, sharding: str, kernel: str, shards: int) -> _Key:
    return table, sharding, kernel, shards if sharding in _SLICED else 0


def torchrec_terms(search_space: Sequence[ShardingOption], compute_device: str) -> dict[_Key, tuple[NeoPerf,
                                                                                                     NeoStorage]]:
    """TorchRec's shard estimators' figures of every enumerated option, as neocfg's per-piece terms: the largest
    shard's perf (ms) and storage (on CPU TorchRec counts a rank's memory as DDR, neocfg as the device's own)."""
    out: dict[_Key, tuple[NeoPerf, NeoStorage]] = {}
    for o in search_space:
        shards = [s for s in o.shards if s.perf is not None and s.storage is not None]
        if not shards:
            continue
        p = max((s.perf for s in shards), key=lambda x: x.total)
        st = max((s.storage for s in shards), key=lambda x: x.hbm + x.ddr)
        perf = NeoPerf(fwd_compute=p.fwd_compute + p.prefetch_compute, bwd_compute=p.bwd_compute,
                       fwd_comm=p.fwd_comms, bwd_comm=p.bwd_comms)
        storage = NeoStorage(st.hbm + st.ddr, 0) if compute_device == "cpu" else NeoStorage(st.hbm, st.ddr)
        out[_key(o.name, o.sharding_type, o.compute_kernel, len(o.shards))] = (perf, storage)
    return out


@dataclass(frozen=True)
class TorchRecTermsCost(CostModel):
    """neocfg's cost model with TorchRec's per-option storage (always: the storage reservation's percentage is
    TorchRec's, sized against its storage estimates) and, with `use_perf`, TorchRec's per-option perf, so the ILP
    minimizes what TorchRec's planner minimizes (the busiest rank's summed shard perf) plus neocfg's per-step fixed
    terms. Options TorchRec did not enumerate keep neocfg's own terms (they are never chosen: see _option_of)."""

    terms: Mapping[_Key, tuple[NeoPerf, NeoStorage]] = field(default_factory=dict)
    use_perf: bool = True
    # tables in kernels neocfg does not model (StandIns): TorchRec's perf whatever use_perf says
    theirs: frozenset[str] = frozenset()

    @staticmethod
    def of(cost: CostModel, terms: Mapping[_Key, tuple[NeoPerf, NeoStorage]], use_perf: bool,
           theirs: frozenset[str] = frozenset()) -> "TorchRecTermsCost":
        fields = {f.name: getattr(cost, f.name) for f in dataclasses.fields(CostModel)}
        if use_perf:   # TorchRec's rating has no per-step fixed terms: its shard perf is the whole objective
            fields.update(dict.fromkeys(_FIXED_TERMS, 0.0))
        return TorchRecTermsCost(**fields, terms=terms, use_perf=use_perf, theirs=theirs)

    def piece(self, table, sharding, tier, dtype, num_pieces):
        perf, storage = super().piece(table, sharding, tier, dtype, num_pieces)
        kernel = DATA_PARALLEL_KERNEL if sharding is ShardingType.data_parallel else KERNEL_OF_TIER[tier]
        got = self.terms.get(_key(table.name, sharding.value, kernel, num_pieces))
        if got is None:
            return perf, storage
        return (got[0] if self.use_perf or table.name in self.theirs else perf), got[1]


class NeocfgShardingPlanner:
    """TorchRec's EmbeddingShardingPlanner with neocfg's ILP inside: constructed the same way (1.8's arguments, in
    its order) and plan(module, sharders) returns a TorchRec ShardingPlan.

    What each argument does here: `topology`, `batch_size`, `constraints` as in TorchRec; `enumerator` (default
    TorchRec's EmbeddingEnumerator) gives each table's options, bounded by the sharders' sharding_types() and
    compute_kernels() and the constraints; `storage_reservation` (default TorchRec's HeuristicalStorageReservation,
    15 %) reserves memory for the module's dense parameters, optimizer state and KJT buffers; `stats` receive the
    plan (TorchRec's EmbeddingStats by default); `callbacks` edit the chosen options; `timeout_seconds` is the
    solver's time limit; `plan_loader` supplies a stored plan as in TorchRec (context hash checked first).
    `proposer`, `partitioner` and `performance_model` have no meaning for an ILP and are accepted with a warning.

    neocfg's own extras (keyword only): `hardware` names a neocfg preset (conf/hardware) used as the base under the
    Topology, or instead of it; `overrides` are further neocfg overrides ("planner.mip_gap=0.02"). After plan(),
    `last_plan` holds neocfg's Plan (estimates, solver report) and `last_seconds` the planning time."""

    def __init__(self, topology: Optional[Topology] = None, batch_size: Optional[int] = None,
                 enumerator: Optional[Enumerator] = None, storage_reservation: Optional[StorageReservation] = None,
                 proposer: Any = None, partitioner: Any = None, performance_model: Any = None,
                 stats: Optional[Stats | list[Stats]] = None,
                 constraints: Optional[Mapping[str, ParameterConstraints]] = None, debug: bool = True,
                 callbacks: Optional[list[Callable[[list[ShardingOption]], list[ShardingOption]]]] = None,
                 timeout_seconds: Optional[int] = None, plan_loader: Optional[PlanLoader] = None, *,
                 hardware: Optional[str] = None, overrides: Sequence[str] = (), estimator: str = "torchrec",
                 model_name: str = "torchrec_model") -> None:
        if estimator not in ESTIMATORS:
            raise PlannerError(f"estimator={estimator!r}: allowed {', '.join(ESTIMATORS)}",
                               PlannerErrorType.INPUT_VALIDATION)
        self.estimator = estimator
        proposers = [] if proposer is None else (list(proposer) if isinstance(proposer, list) else [proposer])
        # EmbeddingOffloadScaleupProposer's search space is kept (each table's option it proposes first); its cache
        # scale-up is not (the cache ratio stays the constraint's load factor, or planner.cache_ratio)
        self._offload = next((p for p in proposers if isinstance(p, EmbeddingOffloadScaleupProposer)), None)
        if self._offload is not None:
            _warn_once("scaleup", "NeocfgShardingPlanner: EmbeddingOffloadScaleupProposer: each table is planned in "
                                  "the option that proposer proposes first; caches are not scaled up")
        for name, value in (("proposer", None if self._offload else proposer), ("partitioner", partitioner),
                            ("performance_model", performance_model)):
            if value is not None:
                _warn_once(name, f"NeocfgShardingPlanner: {name}= is ignored (neocfg solves one ILP over every "
                                 f"option; it has no {name})")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise PlannerError(f"timeout_seconds={timeout_seconds}: must be positive",
                               PlannerErrorType.INPUT_VALIDATION)
        if topology is None:
            topology = _topology_of_preset(hardware) if hardware is not None else _default_topology()
        self._topology: Topology = topology
        self._batch_size: int = batch_size if batch_size else BATCH_SIZE
        self._constraints = dict(constraints) if constraints is not None else None
        self._enumerator: Enumerator = enumerator if enumerator is not None else EmbeddingEnumerator(
            topology=topology, batch_size=self._batch_size, constraints=self._constraints)
        self._storage_reservation: StorageReservation = (
            storage_reservation if storage_reservation is not None
            else HeuristicalStorageReservation(percentage=HEURISTICAL_RESERVATION))
        self._stats: list[Stats] = [EmbeddingStats()] if stats is None else \
            (list(stats) if isinstance(stats, list) else [stats])
        self._debug = debug
        self._callbacks = list(callbacks or [])
        self._timeout_seconds = timeout_seconds
        self.plan_loader = plan_loader
        self.hardware, self.overrides, self.model_name = hardware, list(overrides), model_name
        self._num_proposals = self._num_plans = 0
        self._best_plan: Optional[list[ShardingOption]] = None
        self.last_plan: Optional[Plan] = None
        self.last_seconds = 0.0

    # TorchRec's public attributes of a planner's inputs
    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def constraints(self) -> dict[str, ParameterConstraints]:
        return dict(self._constraints or {})

    @property
    def compute_device(self) -> str:
        return self._topology.compute_device

    def hash_planner_context_inputs(self) -> int:
        """TorchRec's hash of the inputs a stored plan depends on (topology, batch size, enumerator, storage
        reservation, constraints)."""
        return hash_planner_context_inputs(self._topology, self._batch_size, self._enumerator,
                                           self._storage_reservation, self._constraints)

    def hash_planner_context_inputs_str(self) -> str:
        return hash_planner_context_inputs_str(self._topology, self._batch_size, self._enumerator,
                                               self._storage_reservation, self._constraints)

    def _base_config(self, extra: Sequence[str], reserved: Optional[Topology] = None) -> NeocfgConfig:
        preset = self.hardware or DEFAULT_PRESET.get(self.compute_device, "zionex_1node")
        ov = [f"hardware={preset}", *topology_overrides(self._topology, reserved),
              f"train.batch_size={self._batch_size}", "planner.weights_dtypes=[fp32,fp16]",
              "planner.replica_dtypes=[fp32,fp16]"]   # TorchRec's runtime keeps a DP table's dtype
        if self._timeout_seconds is not None:
            ov.append(f"planner.time_limit_s={self._timeout_seconds}")
        if self.estimator == "torchrec":   # the gap is relative to a step time the constant dense part dominates
            ov.append(f"planner.mip_gap={TORCHREC_ESTIMATOR_MIP_GAP}")
        return compose_config([*ov, *extra, *self.overrides])

    def _search_space(self, module: nn.Module, sharders: Sequence[ModuleSharder]) -> list[ShardingOption]:
        try:
            options = self._enumerator.enumerate(module=module, sharders=list(sharders))
        except RuntimeError as exc:   # TorchRec's enumerator: no option left for a table
            raise PlannerError(str(exc), PlannerErrorType.STRICT_CONSTRAINTS) from None
        return options if self._offload is None else self._proposed(options)

    def _proposed(self, search_space: list[ShardingOption]) -> list[ShardingOption]:
        """EmbeddingOffloadScaleupProposer's search space: the one option per table it proposes first (TorchRec's
        proposer keeps each table's best-scored fused_uvm_caching option, promoted to fused where prefetching costs
        more than offloading saves). A copy of the user's proposer is loaded, as TorchRec's planner loads it; neocfg
        places those options on ranks and does not scale the caches up."""
        proposer = copy.deepcopy(self._offload)
        proposer.load(search_space=copy.deepcopy(search_space), enumerator=self._enumerator)
        chosen = {(o.name, o.sharding_type, o.compute_kernel, len(o.shards)) for o in proposer.starting_proposal}
        return [o for o in search_space if (o.name, o.sharding_type, o.compute_kernel, len(o.shards)) in chosen]

    def _config_of(self, module: nn.Module, sharders: Sequence[ModuleSharder], space: StandIns,
                   reserved: Optional[Topology]) -> NeocfgConfig:
        found = find_tables(module, sharders)
        for f in found:
            _check_table(f.config, (self._constraints or {}).get(f.config.name), self.compute_device)
        model = model_config(found, self._constraints or {}, space.options, self._batch_size, self.model_name,
                             space.real_kernel)
        types = sorted({s.value for t in model.tables for s in t.sharding_types or []})
        extra = [f"planner.sharding_types=[{','.join(types)}]"]
        if reserved is not None:
            extra.append("planner.dense_resident_bytes=0")
        cfg = dataclasses.replace(self._base_config(extra, reserved), model=model)
        cfg.check()
        return cfg

    def config(self, module: nn.Module, sharders: Optional[Sequence[ModuleSharder]] = None) -> NeocfgConfig:
        """The neocfg config this planner solves for the module (model from its tables, hardware, planner)."""
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        reserved = self._storage_reservation.reserve(topology=self._topology, batch_size=self._batch_size,
                                                     module=module, sharders=sharders, constraints=self._constraints)
        return self._config_of(module, sharders, stand_in_kernels(self._search_space(module, sharders)), reserved)

    def plan(self, module: nn.Module, sharders: Optional[Sequence[ModuleSharder]] = None) -> ShardingPlan:
        start = time.perf_counter()
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        self._num_proposals = self._num_plans = 0
        reserved = self._storage_reservation.reserve(topology=self._topology, batch_size=self._batch_size,
                                                     module=module, sharders=sharders, constraints=self._constraints)
        search_space = self._search_space(module, sharders)
        if not search_space:   # nothing to shard (no sharders, or no table they handle)
            return ShardingPlan({})
        best = self._loaded_plan(search_space)
        if best is None:
            best = self._solve(module, sharders, search_space, reserved)
        for callback in self._callbacks:
            best = callback(best)
        self._best_plan = best
        sharding_plan = options_to_sharding_plan(best, self._topology)
        self.last_seconds = time.perf_counter() - start
        for stats in self._stats:
            stats.log(sharding_plan=sharding_plan, topology=self._topology, batch_size=self._batch_size,
                      storage_reservation=self._storage_reservation, num_proposals=self._num_proposals,
                      num_plans=self._num_plans, run_time=self.last_seconds, best_plan=best,
                      constraints=self._constraints, sharders=sharders, enumerator=self._enumerator,
                      debug=self._debug)
        return sharding_plan

    def _loaded_plan(self, search_space: list[ShardingOption]) -> Optional[list[ShardingOption]]:
        """The plan_loader's stored plan, as TorchRec loads it: refused when the planner's context hash differs."""
        if self.plan_loader is None:
            return None
        mine, theirs = self.hash_planner_context_inputs_str(), self.plan_loader.plan_context_hash()
        if theirs is not None and theirs != mine:
            raise PlannerError(f"Unable to load plan {self.plan_loader.get_plan_id()}: planner input mismatch (the "
                               f"stored plan's context hash {theirs} is not this planner's {mine})",
                               PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH)
        loaded = self.plan_loader.load()
        if loaded is None:
            return None
        return copy.deepcopy(extract_plan(search_space=search_space, loaded_sharding_options=loaded)) or None

    def _solve(self, module: nn.Module, sharders: Sequence[ModuleSharder], search_space: list[ShardingOption],
               reserved: Topology) -> list[ShardingOption]:
        from neocfg.planner.pipeline import plan_placement

        if _storage_failure(search_space, reserved):   # as TorchRec: no proposal can fit, none is made
            raise PlannerError(f"Unable to find a plan for this model because of insufficient storage: the smallest "
                               f"option of every table does not fit the {self._topology.world_size} devices' memory "
                               f"left after the storage reservation", PlannerErrorType.INSUFFICIENT_STORAGE)
        stand_ins = stand_in_kernels(search_space)
        search_space = stand_ins.options
        cfg = self._config_of(module, sharders, stand_ins, reserved)
        self._num_proposals += 1
        base = CostModel.from_config(cfg)
        base = dataclasses.replace(base, rank_capacity=rank_capacity(reserved, base))
        cost = TorchRecTermsCost.of(base, torchrec_terms(search_space, self.compute_device),
                                    use_perf=self.estimator == "torchrec", theirs=stand_ins.tables)
        try:
            self.last_plan = plan_placement(cfg, cost)
        except InfeasibleError as exc:
            raise PlannerError(f"Unable to find a plan for this model because of the strict constraints: {exc}",
                               PlannerErrorType.STRICT_CONSTRAINTS) from None
        except ConfigError as exc:
            raise PlannerError(f"Unable to find a plan for this model: {exc}",
                               PlannerErrorType.STRICT_CONSTRAINTS) from None
        self._num_plans += 1
        order = {f.config.name: i for i, f in enumerate(find_tables(module, sharders))}
        chosen = [stand_ins.restore(_option_of(t, search_space, self._topology.compute_device))
                  for t in self.last_plan.tables]
        return sorted(chosen, key=lambda o: order[o.name])

    def collective_plan(self, module: nn.Module, sharders: Optional[Sequence[ModuleSharder]] = None,
                        pg: Optional[dist.ProcessGroup] = None) -> ShardingPlan:
        """plan() on rank 0, broadcast to the group (as EmbeddingShardingPlanner.collective_plan)."""
        pg = pg if pg is not None else dist.GroupMember.WORLD
        return invoke_on_rank_and_broadcast_result(pg, 0, self.plan, module, sharders)

    def rate(self, module: nn.Module, sharding_plan: ShardingPlan,
             sharders: Optional[Sequence[ModuleSharder]] = None, check_memory: bool = True) -> Plan:
        """neocfg's estimate of any TorchRec ShardingPlan of the module (e.g. EmbeddingShardingPlanner's);
        check_memory False rates it even where neocfg's memory model finds a device over its capacity."""
        from neocfg.planner.estimate import rate_plan

        sharders = list(sharders) if sharders is not None else get_default_sharders()
        cfg = self.config(module, sharders)
        plan = from_sharding_plan(sharding_plan, module, sharders, cfg.hardware.num_devices,
                                  cfg.hardware.devices_per_node, cfg.train.batch_size, cfg.model.name)
        return rate_plan(cfg, plan, "torchrec plan", check_memory=check_memory)


def _option_of(t: TablePlan, search_space: Sequence[ShardingOption], compute_device: str) -> ShardingOption:
    """TorchRec's enumerated option of a neocfg table plan, its shards placed on the plan's ranks (shard order:
    columns left to right, rows top to bottom, as TorchRec's enumerator and neocfg's export both order them)."""
    kernel = compute_kernel(t)
    match = [o for o in search_space if o.name == t.name and o.sharding_type == t.sharding.value
             and o.compute_kernel == kernel]
    entry = table_entry(t)
    ranks = list(entry["ranks"]) if t.sharding is not ShardingType.data_parallel else sorted(s.rank for s in t.shards)
    match = [o for o in match if len(o.shards) == len(ranks)]
    if not match:
        raise PlannerError(f"table {t.name}: neocfg chose {t.sharding.value} with {len(ranks)} shards on kernel "
                           f"{kernel}, which TorchRec's enumerator did not offer for it on {compute_device}",
                           PlannerErrorType.OTHER)
    option = copy.deepcopy(match[0])
    for shard, rank in zip(option.shards, ranks):
        shard.rank = rank
    return option


# ---- converters ----------------------------------------------------------------------------------------------
def to_sharding_plan(exported: Mapping[str, Any], paths: Mapping[str, str]) -> ShardingPlan:
    """A TorchRec ShardingPlan from torchrec_plan.json's data (neocfg.interop.export), each table under the module
    path given for it."""
    device, local = exported["compute_device"], exported["local_world_size"]
    missing = sorted(set(exported["tables"]) - set(paths))
    if missing:
        raise ConfigError("module", missing[0], "is in the plan but in no embedding collection of the module")
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    for name, e in exported["tables"].items():
        spec = None if e["shards"] is None else EnumerableShardingSpec([
            ShardMetadata(shard_offsets=list(s["offsets"]), shard_sizes=list(s["sizes"]),
                          placement=placement(device, s["rank"], local)) for s in e["shards"]])
        module_plan = plan.setdefault(paths[name], EmbeddingModuleShardingPlan())
        module_plan[name] = ParameterSharding(sharding_type=e["sharding_type"], compute_kernel=e["compute_kernel"],
                                              ranks=list(e["ranks"]), sharding_spec=spec)
    return ShardingPlan(plan)


def load_torchrec_plan(path: str | Path, module: nn.Module,
                       sharders: Optional[Sequence[ModuleSharder]] = None) -> ShardingPlan:
    """The ShardingPlan of a torchrec_plan.json (`neocfg mode=plan planner.export=torchrec`) for this module."""
    found = find_tables(module, list(sharders) if sharders is not None else get_default_sharders())
    return to_sharding_plan(read_torchrec_dict(path), {f.config.name: f.path for f in found})


def from_sharding_plan(sharding_plan: ShardingPlan, module: nn.Module, sharders: Sequence[ModuleSharder],
                       world_size: int, devices_per_node: int, batch_size: int, model_name: str) -> Plan:
    """A neocfg Plan (no estimates yet: neocfg.planner.estimate.rate_plan adds them) of a TorchRec ShardingPlan."""
    configs = {f.config.name: f.config for f in find_tables(module, sharders)}
    tables = []
    for module_plan in sharding_plan.plan.values():
        for name, ps in module_plan.items():
            c = configs[name]
            shards = None if ps.sharding_spec is None else [
                {"rank": md.placement.rank(), "offsets": list(md.shard_offsets), "sizes": list(md.shard_sizes)}
                for md in ps.sharding_spec.shards]
            entry = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel, "ranks": ps.ranks,
                     "shards": shards}
            dtype = WeightsDtype.fp16 if c.data_type is DataType.FP16 else WeightsDtype.fp32
            if ps.sharding_type == ShardingType.data_parallel.value:
                dtype = SCHEMES[ShardingType.data_parallel].weights_dtypes[0]   # how neocfg stores replicas
            tables.append(table_plan_of(name, c.num_embeddings, c.embedding_dim, entry, world_size, dtype))
    order = list(configs)
    tables.sort(key=lambda t: order.index(t.name))
    return unrated_plan(model_name, world_size, devices_per_node, batch_size, tuple(tables),
                        algorithm=GIVEN_PLAN_ALGORITHM)


def plan_json_of(sharding_plan: ShardingPlan, module: nn.Module, sharders: Sequence[ModuleSharder],
                 planner: NeocfgShardingPlanner, path: Path) -> Plan:
    """Convert a TorchRec ShardingPlan to a rated neocfg plan.json (for `planner.plan_file=` and mode=train)."""
    rated = planner.rate(module, sharding_plan, sharders)
    rated.save(Path(path))
    return rated


# ---- row-wise on CPU ------------------------------------------------------------------------------------------
class CpuRowWiseEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, also offering row_wise on CPU (its CPU list stops at TW/CW/TWCW/DP; the row-wise
    pieces it needs, block bucketization and reduce-scatter, have CPU and gloo implementations)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if compute_device_type == "cpu" and ShardingType.row_wise.value not in types:
            types = [*types, ShardingType.row_wise.value]
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if compute_device_type == "cpu" and sharding_type == ShardingType.row_wise.value:
            return [EmbeddingComputeKernel.FUSED.value]
        return super().compute_kernels(sharding_type, compute_device_type)


__all__ = ["NeocfgShardingPlanner", "CpuRowWiseEmbeddingBagCollectionSharder", "find_tables", "from_sharding_plan",
           "load_torchrec_plan", "plan_json_of", "to_sharding_plan"]
