"""The embedding part's fixed per-step costs (CostModel.embedding_overhead_ms) split into terms the solvers carry, so
that their objective is the plan's step time and their bound holds for every plan of the enumerated options:

  base_ms    every device, every plan: the id collectives' latency, the id routing and the exchange's kernels
  kinds      every device, per collective group the plan uses (the latency of the collectives that group issues; the
             table-wise, column-wise and table-column-wise outputs share one all-to-all): a "used" indicator each
  group_ms   one device, per fused lookup group it holds (one TBE per weights precision x memory tier)

Every term is derived from the cost model (tests/test_planner_bound.py checks that they add up to it exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from neocfg.planner.costs import CostModel
from neocfg.planner.types import Placement, ShardingOption, Topology
from neocfg.sharding import OUTPUT_COLLECTIVES, SCHEMES
from neocfg.types import MemoryTier, ShardingType, WeightsDtype

GroupKey = tuple[WeightsDtype, MemoryTier]


def collective_groups() -> tuple[tuple[frozenset[ShardingType], int], ...]:
    """The output collectives per step as the runtime batches them: the sharding types of one output kind share
    its collectives (issued once when any of them is in the plan); with how many collectives that is."""
    by_kind: dict = {}
    for sharding, scheme in SCHEMES.items():
        by_kind.setdefault(scheme.kind, set()).add(sharding)
    return tuple((frozenset(ks), OUTPUT_COLLECTIVES[kind]) for kind, ks in by_kind.items())


def restricted_sharding_types() -> list[tuple[ShardingType, ...]]:
    """The restrictions of planner.sharding_types that change which collectives a plan issues: each sharding type
    alone and each collective group of several types. A restricted run's plans are plans of the full option space,
    so none may beat the full run's bound (bench/bench_planner.py --restricted, tests/test_planner_bound.py)."""
    groups = [tuple(sorted(ks, key=lambda s: s.value)) for ks, _ in collective_groups() if len(ks) > 1]
    return [(s,) for s in ShardingType] + groups


def restrictions(shardings: Sequence[ShardingType], tiers: Sequence[MemoryTier],
                 dtypes: Sequence[WeightsDtype]) -> list[tuple[str, tuple[str, ...]]]:
    """Restrictions of a run's option space (planner key, allowed values): those of planner.sharding_types that change
    the collectives issued (restricted_sharding_types, within the run's own types), each memory tier and each weights
    precision alone, and each leaving one of them out. Every restricted plan is a plan of the full option space, so
    no restricted run may beat the full run's bound (bench/bench_planner.py --restricted, tests/)."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for kinds in restricted_sharding_types():
        if set(kinds) < set(shardings):
            out.append(("planner.sharding_types", tuple(k.value for k in kinds)))
    for key, have in (("planner.memory_tiers", tiers), ("planner.weights_dtypes", dtypes)):
        subsets = {(x,) for x in have} | {tuple(y for y in have if y != x) for x in have}
        out += [(key, tuple(x.value for x in sub)) for sub in sorted(subsets, key=lambda s: [x.value for x in s])
                if 0 < len(sub) < len(have)]
    return out


def lookup_group(o: ShardingOption) -> GroupKey:
    """The fused lookup (TBE) a piece of this option joins on its device."""
    return (o.dtype, o.tier)


@dataclass(frozen=True)
class FixedCosts:
    base_ms: float = 0.0
    kinds: tuple[tuple[frozenset[ShardingType], float], ...] = ()
    group_ms: float = 0.0

    @staticmethod
    def of(cost: CostModel) -> "FixedCosts":
        base = cost.embedding_overhead_ms((), 0).total
        group = cost.embedding_overhead_ms((), 1).total - base
        kinds = tuple((ks, cost.collectives_latency_ms(ks) - cost.collectives_latency_ms(()))
                      for ks, _ in collective_groups())
        return FixedCosts(base_ms=base, kinds=kinds, group_ms=group)

    @property
    def is_zero(self) -> bool:
        return self.base_ms == 0 and self.group_ms == 0 and all(ms == 0 for _, ms in self.kinds)

    def kind_ms(self, sharding: ShardingType) -> float:
        """Latency of the collective group this sharding type needs (paid once however many tables use it)."""
        return sum(ms for ks, ms in self.kinds if sharding in ks)

    def shared_ms(self, shardings: Iterable[ShardingType]) -> float:
        """What every device pays in a plan with these sharding types."""
        used = set(shardings)
        return self.base_ms + sum(ms for ks, ms in self.kinds if ks & used)

    def device_times(self, topo: Topology, placements: Sequence[Placement]) -> np.ndarray:
        """Per device: the fixed costs it pays in this plan (add the pieces' time for its embedding time)."""
        groups: list[set[GroupKey]] = [set() for _ in range(topo.world)]
        for p in placements:
            for r in p.ranks:
                groups[r].add(lookup_group(p.option))
        shared = self.shared_ms({p.option.sharding for p in placements})
        return shared + self.group_ms * np.array([len(g) for g in groups], dtype=np.float64)

    def minimum(self, options: Sequence[Sequence[ShardingOption]]) -> float:
        """The least fixed time of the busiest device over every plan of these options: the base, the collective
        group no table can avoid (the largest of each table's cheapest), and one lookup group (the device busiest
        with pieces holds one; with the pieces' bounds this adds up, see bounds.py)."""
        if not options:
            return self.base_ms
        kinds = max(min(self.kind_ms(o.sharding) for o in opts) for opts in options)
        return self.base_ms + kinds + self.group_ms


def plan_embedding_ms(topo: Topology, fixed: FixedCosts, piece_times: np.ndarray,
                      placements: Sequence[Placement]) -> float:
    """The busiest device's embedding time of a plan: its pieces plus its fixed costs."""
    if not len(piece_times):
        return 0.0
    return float(np.max(piece_times + fixed.device_times(topo, placements)))


ZERO = FixedCosts()
