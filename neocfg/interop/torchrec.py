"""neocfg's planner inside TorchRec: a drop-in for `EmbeddingShardingPlanner`, and plan converters both ways.

    planner = NeocfgShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), batch_size=512,
                                    constraints={"t0": ParameterConstraints(pooling_factors=[3.0])})
    plan = planner.plan(model, sharders)            # a torchrec ShardingPlan, as EmbeddingShardingPlanner returns
    model = DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)

The module's EmbeddingBagConfigs (rows, dims, features) and the constraints' pooling factors, sharding types and
compute kernels become a neocfg model; the hardware is a neocfg preset (`hardware="zionex_2node"`) or TorchRec's
Topology (world and local world size and per-device capacities always; bandwidths on CUDA only, where TorchRec's
figures describe a GPU: on CPU the preset's calibrated figures stay). neocfg solves it and each table becomes a
ParameterSharding: sharding type, the compute kernel of its memory tier, ranks, an EnumerableShardingSpec of its
shards. Only sharding types every sharder offers on the compute device are planned (TorchRec's EBC sharder offers no
row-wise on CPU; CpuRowWiseEmbeddingBagCollectionSharder adds it).

TorchRec is an optional dependency: importing this module without it raises an ImportError that says so."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

try:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed._shard.metadata import ShardMetadata
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders, placement
    from torchrec.distributed.types import (EmbeddingModuleShardingPlan, EnumerableShardingSpec, ModuleSharder,
                                            ParameterSharding, ShardingPlan)
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
except ImportError as exc:  # pragma: no cover - exercised where TorchRec is absent
    raise ImportError(f"neocfg.interop.torchrec needs TorchRec ({exc}); install it (`make torchrec-env` builds "
                      f".venv-torchrec) or use neocfg.interop.export, which writes TorchRec plans without it") from exc

from neocfg.config.model import ModelConfig, TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.errors import ConfigError
from neocfg.interop.export import (TIER_OF_KERNEL, compute_device_of, read_torchrec_dict, table_plan_of,
                                   to_torchrec_dict, unrated_plan)
from neocfg.plan import GIVEN_PLAN_ALGORITHM, Plan
from neocfg.sharding import SCHEMES
from neocfg.types import Interaction, MemoryTier, ShardingType, WeightsDtype

GIB = 1024**3
# TorchRec's Topology bandwidths are bytes per millisecond; neocfg's hardware presets use GB/s (1e9 bytes/s).
_BYTES_PER_MS_TO_GBS = 1e3 / 1e9
# TorchRec's default pooling factor per feature when the constraints give none (planner/constants.py POOLING_FACTOR).
TORCHREC_DEFAULT_POOLING = 1.0
# The hardware preset a Topology starts from (its calibrated kernel and collective overheads): per compute device.
DEFAULT_PRESET = {"cpu": "cpu_local", "cuda": "zionex_1node"}


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


def _table_config(t: EmbeddingBagConfig, c: Optional[ParameterConstraints]) -> TableConfig:
    features = max(1, len(t.feature_names))
    pooling = sum(c.pooling_factors) if c is not None and c.pooling_factors else TORCHREC_DEFAULT_POOLING * features
    shardings = None
    tiers = None
    if c is not None and c.sharding_types:
        known = {m.value for m in ShardingType}
        shardings = [ShardingType(s) for s in c.sharding_types if s in known]
    if c is not None and c.compute_kernels:
        tiers = sorted({TIER_OF_KERNEL[k] for k in c.compute_kernels if k in TIER_OF_KERNEL}, key=lambda m: m.value)
        if not tiers and EmbeddingComputeKernel.DENSE.value in c.compute_kernels:
            tiers, shardings = [MemoryTier.hbm], [ShardingType.data_parallel]
    dtype = [WeightsDtype.fp16] if t.data_type is DataType.FP16 else [WeightsDtype.fp32]
    return TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                       pooling_factor=float(pooling), sharding_types=shardings or None, memory_tiers=tiers or None,
                       weights_dtypes=dtype)


def model_config(found: Sequence[FoundTable], constraints: Mapping[str, ParameterConstraints],
                 name: str) -> ModelConfig:
    """The neocfg model of the module's tables. The dense part is unknown to the planner: ModelConfig's defaults
    (the same for every plan, so it shifts every estimate alike); DCN when the tables' dims differ (dot needs one)."""
    tables = [_table_config(f.config, constraints.get(f.config.name)) for f in found]
    dims = {t.embedding_dim for t in tables}
    model = ModelConfig(name=name, tables=tables,
                        interaction=Interaction.dot if len(dims) == 1 else Interaction.dcn)
    model.check("model")
    return model


def topology_overrides(topology: Topology) -> list[str]:
    """neocfg hardware overrides of a TorchRec Topology (see the module docstring for what is taken)."""
    local = topology.local_world_size
    if topology.world_size % local:
        raise ConfigError("topology.world_size", topology.world_size,
                          f"must be a multiple of local_world_size {local}")
    dev = topology.devices[0].storage
    out = [f"hardware.name=torchrec_{topology.compute_device}_{topology.world_size}",
           f"hardware.nodes={topology.world_size // local}", f"hardware.devices_per_node={local}"]
    if topology.compute_device == "cpu":
        out.append(f"hardware.device.hbm_gib={max(dev.ddr, dev.hbm) / GIB}")
        return out
    bw = _BYTES_PER_MS_TO_GBS
    return out + [f"hardware.device.hbm_gib={dev.hbm / GIB}", f"hardware.host.ddr_gib={dev.ddr * local / GIB}",
                  f"hardware.device.hbm_bandwidth_gbs={topology.hbm_mem_bw * bw}",
                  f"hardware.host.pcie_bandwidth_gbs={topology.hbm_to_ddr_mem_bw * bw}",
                  f"hardware.intra_node_bandwidth_gbs={topology.intra_host_bw * bw}",
                  f"hardware.inter_node_bandwidth_gbs={topology.inter_host_bw * bw}"]


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


def _offered(found: Sequence[FoundTable], device: str) -> list[str]:
    """Sharding types every sharder of the module offers on the device (in neocfg's order)."""
    offered = set.intersection(*(set(f.sharder.sharding_types(device)) for f in found))
    return [s.value for s in ShardingType if s.value in offered]


class NeocfgShardingPlanner:
    """Constructed like TorchRec's EmbeddingShardingPlanner (topology, batch_size, constraints); plan(module,
    sharders) returns a TorchRec ShardingPlan solved by neocfg. `hardware` names a neocfg preset (conf/hardware)
    used instead of, or as the base under, the Topology; `overrides` are further neocfg overrides
    (e.g. "planner.time_limit_s=10"). After plan(), `last_plan` holds neocfg's Plan (estimates, solver report)."""

    def __init__(self, topology: Optional[Topology] = None, batch_size: Optional[int] = None,
                 constraints: Optional[Mapping[str, ParameterConstraints]] = None, *,
                 hardware: Optional[str] = None, overrides: Sequence[str] = (),
                 model_name: str = "torchrec_model") -> None:
        if topology is None and hardware is None:
            raise ConfigError("topology", None, "give a TorchRec Topology or a neocfg hardware preset (hardware=...)")
        self.topology, self.constraints = topology, dict(constraints or {})
        self.batch_size = batch_size
        self.hardware, self.overrides, self.model_name = hardware, list(overrides), model_name
        self.last_plan: Optional[Plan] = None
        self.last_seconds = 0.0

    @property
    def compute_device(self) -> str:
        if self.topology is not None:
            return self.topology.compute_device
        return compute_device_of(self._base_config([]).hardware.device.kind)

    def _base_config(self, extra: Sequence[str]) -> NeocfgConfig:
        device = self.topology.compute_device if self.topology is not None else None
        preset = self.hardware or DEFAULT_PRESET.get(device or "cuda", "zionex_1node")
        ov = [f"hardware={preset}"]
        if self.topology is not None:
            ov += topology_overrides(self.topology)
        if self.batch_size is not None:
            ov.append(f"train.batch_size={self.batch_size}")
        return compose_config([*ov, *extra, *self.overrides])

    def config(self, module: nn.Module, sharders: Optional[Sequence[ModuleSharder]] = None) -> NeocfgConfig:
        """The neocfg config this planner solves for the module (model from its tables, hardware, planner)."""
        found = find_tables(module, list(sharders) if sharders is not None else get_default_sharders())
        device = self.compute_device
        types = _offered(found, device)
        cfg = self._base_config([f"planner.sharding_types=[{','.join(types)}]"])
        model = model_config(found, self.constraints, self.model_name)
        cfg = dataclasses.replace(cfg, model=model)
        cfg.check()
        return cfg

    def plan(self, module: nn.Module, sharders: Optional[Sequence[ModuleSharder]] = None) -> ShardingPlan:
        from neocfg.planner.pipeline import plan_placement

        start = time.perf_counter()
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        cfg = self.config(module, sharders)
        self.last_plan = plan_placement(cfg)
        sp = to_sharding_plan(to_torchrec_dict(self.last_plan, self.compute_device),
                              {f.config.name: f.path for f in find_tables(module, sharders)})
        self.last_seconds = time.perf_counter() - start
        return sp

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
