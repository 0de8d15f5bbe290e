"""Per-device load bookkeeping shared by every algorithm: time, memory, and the feasible ranks for a piece."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from neocfg.planner.types import Placement, ShardingOption, Spread, Storage, Topology


@dataclass
class DeviceLoads:
    """Mutable accumulator owned by one algorithm run (never shared)."""

    topo: Topology
    capacity: Storage
    time: np.ndarray = field(init=False)
    hbm: np.ndarray = field(init=False)
    host: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        w = self.topo.world
        self.time = np.zeros(w)
        self.hbm = np.zeros(w, dtype=np.int64)
        self.host = np.zeros(w, dtype=np.int64)

    @staticmethod
    def of(topo: Topology, capacity: Storage, placements: Iterable[Placement]) -> "DeviceLoads":
        loads = DeviceLoads(topo, capacity)
        for p in placements:
            loads.add(p)
        return loads

    def fits_mask(self, option: ShardingOption) -> np.ndarray:
        return ((self.hbm + option.storage.hbm <= self.capacity.hbm)
                & (self.host + option.storage.host <= self.capacity.host))

    def add(self, placement: Placement, sign: int = 1) -> None:
        o = placement.option
        idx = np.fromiter(placement.ranks, dtype=np.int64)
        self.time[idx] += sign * o.perf.total
        self.hbm[idx] += sign * o.storage.hbm
        self.host[idx] += sign * o.storage.host

    def over_capacity(self) -> Optional[int]:
        bad = np.nonzero((self.hbm > self.capacity.hbm) | (self.host > self.capacity.host))[0]
        return int(bad[0]) if len(bad) else None

    def best_ranks(self, option: ShardingOption) -> Optional[tuple[int, ...]]:
        """Least-loaded ranks with memory room for the option's pieces (None if it cannot be placed now)."""
        fits = self.fits_mask(option)
        if option.fixed_ranks is not None:
            return option.fixed_ranks if all(fits[r] for r in option.fixed_ranks) else None
        spread, topo = option.spread, self.topo
        if spread is Spread.world:
            return tuple(range(topo.world)) if fits.all() else None
        if spread is Spread.one or spread is Spread.distinct:
            return _k_least(self.time, fits, option.num_pieces, offset=0)
        best: Optional[tuple[float, tuple[int, ...]]] = None
        p = topo.devices_per_node
        for node in range(topo.nodes):
            sl = slice(node * p, (node + 1) * p)
            if spread is Spread.node:
                if not fits[sl].all():
                    continue
                ranks = topo.node_ranks(node)
            else:
                ranks = _k_least(self.time[sl], fits[sl], option.num_pieces, offset=node * p)
                if ranks is None:
                    continue
            peak = float(max(self.time[list(ranks)]))
            if best is None or peak < best[0]:
                best = (peak, ranks)
        return None if best is None else best[1]


def _k_least(time: np.ndarray, fits: np.ndarray, k: int, offset: int) -> Optional[tuple[int, ...]]:
    cand = np.nonzero(fits)[0]
    if len(cand) < k:
        return None
    if k == 1:
        return (int(cand[np.argmin(time[cand])]) + offset,)
    order = cand[np.argsort(time[cand], kind="stable")[:k]]
    return tuple(int(r) + offset for r in order)
