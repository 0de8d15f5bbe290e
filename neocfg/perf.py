"""Estimated time of one device's step, split into forward/backward compute and communication: what a sharding
type's cost terms (neocfg.sharding) and the planner's cost model (neocfg.planner.costs) both produce."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Perf:
    """Estimated milliseconds per training step on one device."""

    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0

    @property
    def compute(self) -> float:
        return self.fwd_compute + self.bwd_compute

    @property
    def comm(self) -> float:
        return self.fwd_comm + self.bwd_comm

    @cached_property
    def total(self) -> float:
        return self.compute + self.comm

    def __add__(self, other: "Perf") -> "Perf":
        return Perf(self.fwd_compute + other.fwd_compute, self.bwd_compute + other.bwd_compute,
                    self.fwd_comm + other.fwd_comm, self.bwd_comm + other.bwd_comm)

    def __mul__(self, k: float) -> "Perf":
        return Perf(self.fwd_compute * k, self.bwd_compute * k, self.fwd_comm * k, self.bwd_comm * k)

    __rmul__ = __mul__
