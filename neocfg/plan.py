"""The plan: what the planner decides and the runtime executes. Serialized as plan.json (a contract; keys are kept).

Shards of a table:
  table_wise         one shard, all rows and columns, on one rank
  column_wise        k shards, all rows, consecutive column slices, each on a rank (any node)
  table_column_wise  like column_wise, all slices on the ranks of one node
  row_wise           one shard per rank of the world, consecutive row ranges, all columns
  table_row_wise     one shard per rank of one node, consecutive row ranges, all columns
  data_parallel      one full replica per rank
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from neocfg.fileio import read_json, write_text_atomic
from neocfg.types import (Carries, CollectiveKind, CommDtype, DenseGradSync, GroupScope, IdDtype, IdsExchange,
                          MemoryTier, RoutingEncoding, ShardingType, WeightsDtype)

PLAN_FORMAT_VERSION = 1
# SolverReport.algorithm of a plan rated as given (planner.plan_file in mode=plan, a converted TorchRec plan).
GIVEN_PLAN_ALGORITHM = "given"


@dataclass(frozen=True)
class Shard:
    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


@dataclass(frozen=True)
class TablePlan:
    name: str
    num_embeddings: int
    embedding_dim: int
    sharding: ShardingType
    memory: MemoryTier
    weights_dtype: WeightsDtype
    shards: tuple[Shard, ...]
    # Fraction of rows cached in HBM when memory is uvm_caching (0 otherwise).
    cache_ratio: float = 0.0


@dataclass(frozen=True)
class DeviceEstimate:
    rank: int
    hbm_bytes: int
    host_bytes: int
    compute_ms: float
    comm_ms: float
    total_ms: float
    # Shard counts per sharding type (keys: ShardingType values).
    shard_counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    step_ms: float
    samples_per_s: float
    # The dense part (MLPs, DDP all-reduce) inside every device's compute_ms / comm_ms / total_ms.
    dense_ms: float = 0.0
    dense_compute_ms: float = 0.0
    dense_comm_ms: float = 0.0
    # Generating the batch where it shares the device's core (CPU ranks; planner.costs.data_ms), in every total_ms.
    data_ms: float = 0.0
    # The pooled outputs' all-to-all (forward and the gradients' backward) hidden behind the bottom MLP on the
    # busiest device (StepStrategies.output_overlap; neocfg.planner.assemble.output_overlap_ms): already taken out of
    # its comm_ms, counted once in the dense term.
    output_hidden_ms: float = 0.0
    # The data-parallel tables' backward inside the embedding terms (0 without them): their lookups' backward and
    # the replicas' update passes, and their gradient all-reduce (neocfg.planner.assemble.replica_backward_ms).
    dp_update_ms: float = 0.0
    dp_all_reduce_ms: float = 0.0

    def embedding_terms_ms(self, devices: "tuple[DeviceEstimate, ...]") -> tuple[float, float]:
        """(compute, comm) of the embedding part on the busiest device: the device terms less the dense part."""
        compute = max((d.compute_ms for d in devices), default=0.0) - self.dense_compute_ms
        comm = max((d.comm_ms for d in devices), default=0.0) - self.dense_comm_ms
        return compute, comm


@dataclass(frozen=True)
class SolverReport:
    algorithm: str
    status: str
    seconds: float
    objective_ms: float
    lower_bound_ms: float
    gap: float
    # which method produced the kept placement (neocfg.planner.types.PlacementSource; "n/a" for rule-made plans)
    placement_source: str = "n/a"


@dataclass(frozen=True)
class DppSizing:
    workers: int
    workers_per_trainer_node: float
    bottleneck: str
    demand_samples_per_s: float
    capacity_samples_per_s: float
    workers_by_shape: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepStrategies:
    """How the runtime runs a step of this plan: every choice that changes what a step issues and costs, resolved by
    the planner from config and hardware (neocfg.planner.strategies) or pinned in a given plan file. The runtime
    reads these and decides none of them itself."""

    pipeline: bool                        # the next batch's ids sent while this one computes (one id collective)
    ids_exchange: IdsExchange             # step or prefetch (a CPU rank's data-source thread, a batch ahead)
    dense_grad_sync: DenseGradSync        # ddp (DDP's all-reduce) or exchange (in the embeddings' backward a2a)
    id_dtype: IdDtype                     # what ids, lengths and bag codes travel as
    routing_encoding: RoutingEncoding     # how row-sharded tables' ids travel
    id_weights: bool = False              # per-id weights travel beside the ids (a dataset's weight columns)
    # the pooled outputs' all-to-all travels while the bottom MLP runs, its gradients' while its backward runs (a
    # plan file without the key: waited for at once)
    output_overlap: bool = False
    # the data source's prefetch thread runs at idle priority (SCHED_IDLE: in the rank's waits; a plan file without
    # the key: the default class)
    prefetch_idle: bool = False
    # the row-wise tables' partial sums travel by an all-to-all and are summed on arrival (a plan file without the
    # key: by reduce-scatter)
    sums_by_all_to_all: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "StepStrategies":
        return StepStrategies(pipeline=bool(d["pipeline"]), ids_exchange=IdsExchange(d["ids_exchange"]),
                              dense_grad_sync=DenseGradSync(d["dense_grad_sync"]), id_dtype=IdDtype(d["id_dtype"]),
                              routing_encoding=RoutingEncoding(d["routing_encoding"]),
                              id_weights=bool(d.get("id_weights", False)),
                              output_overlap=bool(d.get("output_overlap", False)),
                              prefetch_idle=bool(d.get("prefetch_idle", False)),
                              sums_by_all_to_all=bool(d.get("sums_by_all_to_all", False)))

    def describe(self) -> str:
        return (f"pipeline {'on' if self.pipeline else 'off'}, ids exchanged in the {self.ids_exchange.value},"
                f" dense gradients by {self.dense_grad_sync.value}, ids {self.id_dtype.value},"
                f" row-sharded ids as {self.routing_encoding.value}" + (", per-id weights" if self.id_weights else "")
                + f", outputs' all-to-all {'overlapping the bottom MLP' if self.output_overlap else 'waited for at once'}"
                + (", prefetch thread at idle priority" if self.prefetch_idle else "")
                + (", row-wise partial sums by all-to-all" if self.sums_by_all_to_all else ""))


@dataclass(frozen=True)
class Collective:
    """One collective of a rank's step: `count` calls a step (each rank issues the same ones, in the same order,
    on the group's ranks), moving `sent` / `received` bytes in all; overlapped: it runs beside compute (the
    pipelined step's id payload, ids exchanged in the prefetch thread, DDP's buckets during backward, the outputs'
    all-to-all and its gradients' beside the bottom MLP under StepStrategies.output_overlap)."""

    kind: CollectiveKind
    group: GroupScope
    carries: Carries
    count: int
    sent: float
    received: float
    overlapped: bool = False

    @property
    def key(self) -> tuple[CollectiveKind, GroupScope, Carries]:
        return self.kind, self.group, self.carries

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind.value, "group": self.group.value, "carries": self.carries.value,
                "count": self.count, "sent": round(self.sent), "received": round(self.received),
                "overlapped": self.overlapped}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Collective":
        return Collective(kind=CollectiveKind(d["kind"]), group=GroupScope(d["group"]), carries=Carries(d["carries"]),
                          count=int(d["count"]), sent=float(d["sent"]), received=float(d["received"]),
                          overlapped=bool(d.get("overlapped", False)))


@dataclass(frozen=True)
class Plan:
    model_name: str
    world_size: int
    nodes: int
    devices_per_node: int
    batch_size_per_device: int
    a2a_fwd_dtype: CommDtype
    a2a_bwd_dtype: CommDtype
    tables: tuple[TablePlan, ...]
    devices: tuple[DeviceEstimate, ...]
    estimate: Estimate
    solver: SolverReport
    dpp: Optional[DppSizing] = None
    strategies: Optional[StepStrategies] = None
    # Every rank's collectives per step under the strategies (neocfg.sharding.collectives.step_collectives): what
    # the planner priced and the runtime issues. Derived: a plan file's list is re-derived when it is loaded to run.
    collectives: tuple[tuple[Collective, ...], ...] = ()

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def placement_signature(self) -> list[Any]:
        """What must match between a checkpoint and the plan it is resumed with (placement, not estimates)."""
        return [self.world_size, [(t.name, t.num_embeddings, t.embedding_dim, t.sharding.value, t.memory.value,
                                   t.weights_dtype.value, [tuple(asdict(s).values()) for s in t.shards])
                                  for t in self.tables]]

    def to_dict(self) -> dict[str, Any]:
        def enc(obj: Any) -> Any:
            if isinstance(obj, Enum):
                return obj.value
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [enc(v) for v in obj]
            return obj

        d = {"format_version": PLAN_FORMAT_VERSION}
        d.update({k: enc(v) for k, v in asdict(self).items() if k != "collectives"})
        d["collectives"] = [[c.to_dict() for c in rank] for rank in self.collectives]
        # asdict recursed through the dataclasses but kept the enums; enc turned them into their names.
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        tables = tuple(
            TablePlan(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                      sharding=ShardingType(t["sharding"]), memory=MemoryTier(t["memory"]),
                      weights_dtype=WeightsDtype(t["weights_dtype"]),
                      shards=tuple(Shard(**s) for s in t["shards"]), cache_ratio=t.get("cache_ratio", 0.0))
            for t in d["tables"])
        return Plan(
            model_name=d["model_name"], world_size=d["world_size"], nodes=d["nodes"],
            devices_per_node=d["devices_per_node"], batch_size_per_device=d["batch_size_per_device"],
            a2a_fwd_dtype=CommDtype(d["a2a_fwd_dtype"]), a2a_bwd_dtype=CommDtype(d["a2a_bwd_dtype"]),
            tables=tables, devices=tuple(DeviceEstimate(**x) for x in d["devices"]),
            estimate=Estimate(**d["estimate"]), solver=SolverReport(**d["solver"]),
            dpp=DppSizing(**d["dpp"]) if d.get("dpp") else None,
            strategies=StepStrategies.from_dict(d["strategies"]) if d.get("strategies") else None,
            collectives=tuple(tuple(Collective.from_dict(c) for c in rank) for rank in d.get("collectives", ())))

    def save(self, path: Path) -> None:
        """Write atomically: a crash leaves either the old file or the new one, never half of one."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> "Plan":
        return read_json(path, Plan.from_dict, "plan file not found", "not a valid neocfg plan.json")
