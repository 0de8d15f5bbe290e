"""Per-device load bookkeeping shared by every algorithm: time, memory, and the feasible ranks for a piece."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from neocfg.planner.types import Placement, ShardingOption, Spread, Storage, Topology


@dataclass(frozen=True)
class Peak:
    """The largest load among some ranks."""

    time: float
    hbm: int
    host: int


@dataclass
class DeviceLoads:
    """Mutable accumulator owned by one algorithm run (never shared)."""

    topo: Topology
    capacity: Storage
    # Each rank's own capacity where devices differ (CostModel.rank_capacity); () = `capacity` on every rank.
    rank_capacity: tuple[Storage, ...] = ()
    time: np.ndarray = field(init=False)
    hbm: np.ndarray = field(init=False)
    host: np.ndarray = field(init=False)
    cap_hbm: np.ndarray = field(init=False)
    cap_host: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        w = self.topo.world
        self.time = np.zeros(w)
        self.hbm = np.zeros(w, dtype=np.int64)
        self.host = np.zeros(w, dtype=np.int64)
        per_rank = self.rank_capacity or (self.capacity,) * w
        self.cap_hbm = np.array([c.hbm for c in per_rank], dtype=np.int64)
        self.cap_host = np.array([c.host for c in per_rank], dtype=np.int64)

    @staticmethod
    def of(topo: Topology, capacity: Storage, placements: Iterable[Placement],
           rank_capacity: tuple[Storage, ...] = ()) -> "DeviceLoads":
        loads = DeviceLoads(topo, capacity, rank_capacity)
        for p in placements:
            loads.add(p)
        return loads

    def fits_mask(self, option: ShardingOption) -> np.ndarray:
        return self.room(option.storage.hbm, option.storage.host)

    def room(self, hbm: int, host: int) -> np.ndarray:
        """Devices with room for a piece of that much memory."""
        return (self.hbm + hbm <= self.cap_hbm) & (self.host + host <= self.cap_host)

    def peak(self, ranks: tuple[int, ...]) -> "Peak":
        """The largest time, HBM and host memory among these ranks."""
        idx = np.fromiter(ranks, dtype=np.int64)
        return Peak(float(self.time[idx].max()), int(self.hbm[idx].max()), int(self.host[idx].max()))

    def add(self, placement: Placement, sign: int = 1) -> None:
        o = placement.option
        idx = np.fromiter(placement.ranks, dtype=np.int64)
        self.time[idx] += sign * o.perf.total
        self.hbm[idx] += sign * o.storage.hbm
        self.host[idx] += sign * o.storage.host

    def over_capacity(self) -> Optional[int]:
        bad = np.nonzero((self.hbm > self.cap_hbm) | (self.host > self.cap_host))[0]
        return int(bad[0]) if len(bad) else None

    def best_ranks(self, option: ShardingOption, fits: Optional[np.ndarray] = None) -> Optional[tuple[int, ...]]:
        """Least-loaded ranks with memory room for the option's pieces (None if it cannot be placed now); `fits`:
        the devices with room, when already known."""
        fits = self.fits_mask(option) if fits is None else fits
        if option.fixed_ranks is not None:
            return option.fixed_ranks if all(fits[r] for r in option.fixed_ranks) else None
        spread, topo = option.spread, self.topo
        if spread is Spread.world:
            return tuple(range(topo.world)) if fits.all() else None
        if spread is Spread.one or spread is Spread.distinct:
            return _k_least(self.time, fits, option.num_pieces)
        # one node: per node, the k least-loaded devices with room (all of them for table-row-wise); the node whose
        # busiest chosen device is least loaded (first such node on ties)
        p = topo.devices_per_node
        k = p if spread is Spread.node else option.num_pieces
        masked = np.where(fits, self.time, np.inf).reshape(topo.nodes, p)
        order = np.argsort(masked, axis=1, kind="stable")[:, :k]
        peak = np.take_along_axis(masked, order, axis=1).max(axis=1)
        node = int(np.argmin(peak))
        if not np.isfinite(peak[node]):
            return None
        ranks = order[node] + node * p
        return tuple(sorted(int(r) for r in ranks)) if spread is Spread.node else tuple(int(r) for r in ranks)


def _k_least(time: np.ndarray, fits: np.ndarray, k: int) -> Optional[tuple[int, ...]]:
    """The k least-loaded devices with room (ascending load, lowest rank first on ties)."""
    cand = np.flatnonzero(fits)
    if len(cand) < k:
        return None
    if k == 1:
        return (int(cand[np.argmin(time[cand])]),)
    order = cand[np.argsort(time[cand], kind="stable")[:k]]
    return tuple(int(r) for r in order)
