"""neocfg plan <-> TorchRec plan as plain data (no TorchRec import): `mode=plan planner.export=torchrec` writes
torchrec_plan.json; neocfg.interop.torchrec turns it into a TorchRec ShardingPlan (load_torchrec_plan).

torchrec_plan.json:
  format            "neocfg-torchrec-plan", version 1
  world_size, local_world_size, compute_device ("cpu" or "cuda")
  tables.<name>     sharding_type (TorchRec's spelling, the same as neocfg's), compute_kernel, ranks (one per shard,
                    slice order for column splits), shards: [{rank, offsets: [row, col], sizes: [rows, cols]}]
                    (null for data_parallel, whose ParameterSharding has no sharding spec)

The module path of each table (where its EmbeddingBagCollection sits) is found at load time from the module, so one
file serves any module that holds these tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from neocfg.errors import DataError
from neocfg.fileio import write_text_atomic
from neocfg.plan import DeviceEstimate, Estimate, Plan, Shard, SolverReport, TablePlan
from neocfg.sharding import SCHEMES, OutputKind, Routing, row_block, row_ranges
from neocfg.tiers import TIERS
from neocfg.types import CommDtype, DeviceKind, MemoryTier, ShardingType, WeightsDtype

EXPORT_FORMAT = "neocfg-torchrec-plan"
EXPORT_VERSION = 1
EXPORT_FILE = "torchrec_plan.json"

# TorchRec compute kernels (torchrec.distributed.embedding_types.EmbeddingComputeKernel values) per memory tier:
# fused TBE with weights in HBM, in UVM with an HBM cache, in UVM (host memory read over PCIe).
KERNEL_OF_TIER = {tier: t.torchrec_kernel for tier, t in TIERS.items()}
TIER_OF_KERNEL = {v: k for k, v in KERNEL_OF_TIER.items()}
# Data-parallel tables are plain replicated parameters in TorchRec (dense kernel, gradients all-reduced).
DATA_PARALLEL_KERNEL = "dense"


def compute_device_of(kind: DeviceKind) -> str:
    return "cpu" if kind is DeviceKind.cpu else "cuda"


def compute_kernel(t: TablePlan) -> str:
    return DATA_PARALLEL_KERNEL if _replicated(t.sharding) else KERNEL_OF_TIER[t.memory]


def _replicated(sharding: ShardingType) -> bool:
    """Whole replicas (TorchRec's data-parallel: a dense parameter, no sharding spec)."""
    return SCHEMES[sharding].kind is OutputKind.replicated


def ordered_shards(t: TablePlan) -> list[Shard]:
    """TorchRec's shard order: column slices left to right (each slice is a table of its own), others by rank."""
    return SCHEMES[t.sharding].ordered(t.shards)


def _row_split_fault(t: TablePlan, shards: list[Shard]) -> str | None:
    """TorchRec routes a row-wise id to shard id // ceil(rows / shards) (block bucketization): the row ranges must
    be exactly that ceil split, in rank order."""
    block = row_block(t.num_embeddings, len(shards))
    for i, (s, want) in enumerate(zip(shards, row_ranges(t.num_embeddings, len(shards)))):
        if (s.row_offset, s.num_rows) != want:
            return (f"table {t.name}: TorchRec's {t.sharding.value} needs rows split in blocks of ceil("
                    f"{t.num_embeddings}/{len(shards)}) = {block} in rank order; shard {i} (rank {s.rank}) has rows "
                    f"{s.row_offset}..+{s.num_rows}")
    return None


def table_entry(t: TablePlan) -> dict[str, Any]:
    shards = ordered_shards(t)
    if SCHEMES[t.sharding].routing is Routing.by_row:
        fault = _row_split_fault(t, shards)
        if fault:
            raise DataError(fault)
    spec = None if _replicated(t.sharding) else [
        {"rank": s.rank, "offsets": [s.row_offset, s.col_offset], "sizes": [s.num_rows, s.num_cols]}
        for s in shards]
    return {"sharding_type": t.sharding.value, "compute_kernel": compute_kernel(t),
            "ranks": [s.rank for s in shards], "shards": spec}


def to_torchrec_dict(plan: Plan, compute_device: str) -> dict[str, Any]:
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model_name": plan.model_name,
            "world_size": plan.world_size, "local_world_size": plan.devices_per_node,
            "compute_device": compute_device, "tables": {t.name: table_entry(t) for t in plan.tables}}


def write_torchrec_plan(plan: Plan, compute_device: str, path: Path) -> None:
    write_text_atomic(path, json.dumps(to_torchrec_dict(plan, compute_device), indent=1) + "\n")


def read_torchrec_dict(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: TorchRec plan file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a valid {EXPORT_FILE} ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict) or d.get("format") != EXPORT_FORMAT or d.get("version") != EXPORT_VERSION:
        raise DataError(f"{path}: not a {EXPORT_FORMAT} file of version {EXPORT_VERSION} (write one with "
                        f"neocfg mode=plan planner.export=torchrec)")
    return d


def table_plan_of(name: str, num_embeddings: int, embedding_dim: int, entry: Mapping[str, Any],
                  world_size: int, weights_dtype: WeightsDtype = WeightsDtype.fp32) -> TablePlan:
    """A neocfg TablePlan from one TorchRec ParameterSharding (as plain data: the fields of table_entry)."""
    sharding = ShardingType(entry["sharding_type"])
    kernel = entry["compute_kernel"]
    memory = MemoryTier.hbm if kernel == DATA_PARALLEL_KERNEL else TIER_OF_KERNEL.get(kernel)
    if memory is None:
        raise DataError(f"table {name}: compute kernel {kernel!r} has no neocfg memory tier "
                        f"(known: {', '.join([DATA_PARALLEL_KERNEL, *TIER_OF_KERNEL])})")
    if _replicated(sharding) or entry.get("shards") is None:
        ranks = entry.get("ranks") or list(range(world_size))
        shards = tuple(Shard(r, 0, num_embeddings, 0, embedding_dim) for r in ranks)
    else:
        shards = tuple(Shard(s["rank"], s["offsets"][0], s["sizes"][0], s["offsets"][1], s["sizes"][1])
                       for s in entry["shards"])
    return TablePlan(name=name, num_embeddings=num_embeddings, embedding_dim=embedding_dim, sharding=sharding,
                     memory=memory, weights_dtype=weights_dtype,
                     shards=tuple(sorted(shards, key=lambda s: (s.rank, s.col_offset, s.row_offset))))


def unrated_plan(model_name: str, world_size: int, devices_per_node: int, batch_size: int,
                 tables: tuple[TablePlan, ...], algorithm: str) -> Plan:
    """A Plan of given tables with no estimates yet (neocfg.planner.estimate.rate_plan fills them in)."""
    devices = tuple(DeviceEstimate(rank=r, hbm_bytes=0, host_bytes=0, compute_ms=0.0, comm_ms=0.0, total_ms=0.0)
                    for r in range(world_size))
    return Plan(model_name=model_name, world_size=world_size, nodes=world_size // devices_per_node,
                devices_per_node=devices_per_node, batch_size_per_device=batch_size, a2a_fwd_dtype=CommDtype.fp32,
                a2a_bwd_dtype=CommDtype.fp32, tables=tables, devices=devices,
                estimate=Estimate(step_ms=0.0, samples_per_s=0.0),
                solver=SolverReport(algorithm=algorithm, status="not rated", seconds=0.0, objective_ms=0.0,
                                    lower_bound_ms=0.0, gap=0.0))
