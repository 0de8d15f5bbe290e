"""Schema of the `planner` section: which algorithm, its limits, what it may choose, comm precision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from neocfg.config import checks
from neocfg.types import CommDtype, MemoryTier, PlannerAlgorithm, ShardingType, WeightsDtype


@dataclass
class PlannerConfig:
    algorithm: PlannerAlgorithm = PlannerAlgorithm.ilp
    # Wall-clock limit for the ILP solver and the relative gap at which it may stop.
    time_limit_s: float = 45.0
    mip_gap: float = 0.01
    # Use a saved plan.json instead of planning (mode=train).
    plan_file: Optional[str] = None
    # What the planner may choose, for every table (a table's own lists narrow these further).
    sharding_types: List[ShardingType] = field(default_factory=lambda: list(ShardingType))
    memory_tiers: List[MemoryTier] = field(default_factory=lambda: list(MemoryTier))
    weights_dtypes: List[WeightsDtype] = field(default_factory=lambda: [WeightsDtype.fp32])
    # Fraction of a UVM-cached table's rows held in the HBM cache.
    cache_ratio: float = 0.2
    # Precision of the embedding all-to-all, forward (pooled outputs) and backward (their gradients).
    a2a_fwd_dtype: CommDtype = CommDtype.fp32
    a2a_bwd_dtype: CommDtype = CommDtype.fp32

    def check(self, key: str = "planner") -> None:
        checks.positive(f"{key}.time_limit_s", self.time_limit_s)
        checks.in_range(f"{key}.mip_gap", self.mip_gap, 0.0, 1.0)
        checks.non_empty(f"{key}.sharding_types", self.sharding_types)
        checks.non_empty(f"{key}.memory_tiers", self.memory_tiers)
        checks.non_empty(f"{key}.weights_dtypes", self.weights_dtypes)
        checks.in_range(f"{key}.cache_ratio", self.cache_ratio, 0.0, 1.0, lo_open=True)
