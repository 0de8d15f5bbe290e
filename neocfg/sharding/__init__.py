"""One home per sharding type: `SCHEMES[sharding]` gives its placement, shard geometry, validation, routing, output
kind (and so its collectives) and cost terms, read by the planner, the plan validator and the runtime alike.

Adding a sharding type: a ShardingType member (neocfg/types.py) and one module here defining a concrete Scheme
subclass whose `sharding` is that member; every module of this package is imported and its schemes registered
(tests/test_runtime_sharding.py checks every registered scheme's geometry; tests/test_contract.py plans a toy type
added that way; the correctness tests run every type sharded against unsharded).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Iterable

from neocfg.sharding.base import (FBGEMM_DIM_ALIGN, CostTerms, OutputKind, PieceShape, Routing, Scheme, Spread,
                                  ceil_div, column_slices, row_block, row_ranges)
from neocfg.sharding.collectives import GATHER_KINDS, id_collectives, output_collective_kinds, output_collectives
from neocfg.types import ShardingType


def discover(package: str = __name__) -> dict[ShardingType, Scheme]:
    """One instance of every concrete Scheme defined in the modules of this package, by its sharding type."""
    found: dict[ShardingType, Scheme] = {}
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, Scheme) and cls.__module__ == module.__name__ and not inspect.isabstract(cls)
                    and "sharding" in cls.__dict__):
                if cls.sharding in found:
                    raise TypeError(f"sharding type {cls.sharding.value} has two schemes: "
                                    f"{type(found[cls.sharding]).__name__} and {cls.__name__}")
                found[cls.sharding] = cls()
    missing = [s.value for s in ShardingType if s not in found]
    if missing:
        raise TypeError(f"sharding type(s) {', '.join(missing)} have no Scheme in neocfg/sharding/")
    return {s: found[s] for s in ShardingType}


SCHEMES: dict[ShardingType, Scheme] = discover()

# Collectives per step of each output kind (forward + backward), from the records its pieces add
# (neocfg.sharding.collectives): all tables of a kind share them.
OUTPUT_COLLECTIVES = {kind: output_collectives(kind.value) for kind in OutputKind}
# ... of them the reduce-scatters and all-gathers (priced at hardware.reduce_scatter_latency_us where it is given), by
# output kind and whether the row-wise partial sums travel by all-to-all (StepStrategies.sums_by_all_to_all).
GATHER_COLLECTIVES = {(kind, a2a): sum(k in GATHER_KINDS for k in output_collective_kinds(kind.value, a2a))
                      for kind in OutputKind for a2a in (False, True)}
# Id collectives of the unpipelined step (the counts, then the payload): collectives.id_collectives.
IDS_COLLECTIVES = id_collectives(pipeline=False, ahead=False)


def embedding_collectives(shardings: Iterable[ShardingType], ids: int = IDS_COLLECTIVES, world: int = 0,
                          devices_per_node: int = 0) -> int:
    """Collectives per step of a plan whose tables use these sharding types, `ids` of them the id exchange's (the
    runtime batches all tables of an output kind into one collective, so the count depends on the kinds present,
    not on the number of tables). With a topology (world > 0), each type's kind as placed on it
    (Scheme.planned_kind), else its own."""
    return ids + sum(OUTPUT_COLLECTIVES[k] for k in _output_kinds(shardings, world, devices_per_node))


def has_output_kind(tables: Iterable, kind: OutputKind, world: int, devices_per_node: int) -> bool:
    """Some planned table's pooled outputs take this kind: its type's output kind on the ranks its shards sit on
    (neocfg.plan.TablePlan; what the runtime's exchange builds its collectives from)."""
    return any(SCHEMES[t.sharding].output_kind([s.rank for s in t.shards], world, devices_per_node)
               is kind for t in tables)


def has_all_to_all(tables: Iterable, world: int, devices_per_node: int) -> bool:
    """Some planned table's pooled outputs come back by the world's all-to-all."""
    return has_output_kind(tables, OutputKind.all_to_all, world, devices_per_node)


def gather_collectives(shardings: Iterable[ShardingType], world: int = 0, devices_per_node: int = 0,
                       sums_by_all_to_all: bool = False) -> int:
    """How many of embedding_collectives' output collectives are reduce-scatters or all-gathers."""
    return sum(GATHER_COLLECTIVES[k, sums_by_all_to_all] for k in _output_kinds(shardings, world, devices_per_node))


def _output_kinds(shardings: Iterable[ShardingType], world: int, devices_per_node: int) -> set[OutputKind]:
    """The output kinds of these types, each as placed on the topology (Scheme.planned_kind) when one is given."""
    return {SCHEMES[s].planned_kind(world, devices_per_node) if world else SCHEMES[s].kind for s in shardings}


__all__ = ["SCHEMES", "Scheme", "OutputKind", "Routing", "Spread", "PieceShape", "CostTerms", "IDS_COLLECTIVES",
           "OUTPUT_COLLECTIVES", "GATHER_COLLECTIVES", "FBGEMM_DIM_ALIGN", "embedding_collectives",
           "gather_collectives", "has_all_to_all", "has_output_kind", "row_ranges", "row_block", "column_slices",
           "ceil_div", "discover"]
