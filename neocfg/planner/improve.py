"""Local improvement of a placement: while it lowers the busiest device's time and memory allows,
  move  one piece (a table-wise table or a column slice) off the busiest device onto the device that ends lowest, or
  swap  a piece on the busiest device with a lighter piece elsewhere (what memory-full devices need)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from neocfg.planner.loads import DeviceLoads
from neocfg.planner.types import Placement, Spread, Storage, Topology

_MOVABLE = (Spread.one, Spread.distinct)
_MAX_ROUNDS = 5_000
_EPS = 1e-9


@dataclass(frozen=True)
class _Pieces:
    """Every movable piece: its placement index, slot in the placement's ranks, device, time and memory."""

    table: np.ndarray
    slot: np.ndarray
    device: np.ndarray
    time: np.ndarray
    hbm: np.ndarray
    host: np.ndarray

    @staticmethod
    def of(placements: list[Placement]) -> "_Pieces":
        rows = [(t, j, r, p.option.perf.total, p.option.storage.hbm, p.option.storage.host)
                for t, p in enumerate(placements)
                if p.option.fixed_ranks is None and p.option.spread in _MOVABLE
                for j, r in enumerate(p.ranks)]
        cols = list(zip(*rows)) if rows else [[]] * 6
        return _Pieces(*(np.asarray(c, dtype=dt) for c, dt in
                         zip(cols, (np.int64, np.int64, np.int64, np.float64, np.int64, np.int64))))


def improve(topo: Topology, capacity: Storage, placements: list[Placement]) -> list[Placement]:
    placements = list(placements)
    loads = DeviceLoads.of(topo, capacity, placements)
    pieces = _Pieces.of(placements)
    if len(pieces.table) == 0:
        return placements
    # where each (placement, slot) sits among the pieces, to keep pieces.device current after a change
    row = {(int(t), int(j)): i for i, (t, j) in enumerate(zip(pieces.table, pieces.slot))}
    for _ in range(_MAX_ROUNDS):
        busiest = int(np.argmax(loads.time))
        change = _best_move(loads, pieces, placements, busiest) or _best_swap(loads, pieces, placements, busiest)
        if change is None:
            break
        for t, new in change:
            loads.add(placements[t], sign=-1)
            loads.add(new)
            placements[t] = new
            for j, r in enumerate(new.ranks):
                pieces.device[row[(t, j)]] = r
    return placements


def _relocated(p: Placement, slot: int, dest: int) -> Placement:
    ranks = list(p.ranks)
    ranks[slot] = dest
    return Placement(p.option, tuple(ranks))


def _best_move(loads: DeviceLoads, pieces: _Pieces, placements: list[Placement],
               busiest: int) -> Optional[list[tuple[int, Placement]]]:
    peak = float(loads.time[busiest])
    on_b = np.nonzero(pieces.device == busiest)[0]
    free_hbm = loads.capacity.hbm - loads.hbm
    free_host = loads.capacity.host - loads.host
    best: Optional[tuple[float, int, int]] = None
    for a in on_b:
        ok = (free_hbm >= pieces.hbm[a]) & (free_host >= pieces.host[a])
        ok[list(placements[pieces.table[a]].ranks)] = False
        cand = np.nonzero(ok)[0]
        if len(cand) == 0:
            continue
        dest = int(cand[np.argmin(loads.time[cand])])
        after = float(loads.time[dest] + pieces.time[a])
        if after < peak - _EPS and (best is None or after < best[0]):
            best = (after, int(a), dest)
    if best is None:
        return None
    _, a, dest = best
    t = int(pieces.table[a])
    return [(t, _relocated(placements[t], int(pieces.slot[a]), dest))]


def _best_swap(loads: DeviceLoads, pieces: _Pieces, placements: list[Placement],
               busiest: int) -> Optional[list[tuple[int, Placement]]]:
    peak = float(loads.time[busiest])
    cap = loads.capacity
    on_b = np.nonzero(pieces.device == busiest)[0]
    dev = pieces.device
    for a in sorted(on_b, key=lambda i: -pieces.time[i]):
        dt = pieces.time[a] - pieces.time  # time leaving b (a out, c in) and arriving at c's device
        new_b = peak - dt
        new_d = loads.time[dev] + dt
        ok = ((dev != busiest) & (dt > _EPS) & (new_d < peak - _EPS) & (new_b < peak - _EPS)
              & (loads.hbm[busiest] - pieces.hbm[a] + pieces.hbm <= cap.hbm)
              & (loads.host[busiest] - pieces.host[a] + pieces.host <= cap.host)
              & (loads.hbm[dev] - pieces.hbm + pieces.hbm[a] <= cap.hbm)
              & (loads.host[dev] - pieces.host + pieces.host[a] <= cap.host)
              & (pieces.table != pieces.table[a]))
        cand = np.nonzero(ok)[0]
        if len(cand) == 0:
            continue
        score = np.maximum(new_b[cand], new_d[cand])
        ta = int(pieces.table[a])
        for c in cand[np.argsort(score, kind="stable")][:64]:
            tc, d = int(pieces.table[c]), int(dev[c])
            if d in placements[ta].ranks or busiest in placements[tc].ranks:
                continue  # slices of one table must stay on distinct devices
            return [(ta, _relocated(placements[ta], int(pieces.slot[a]), d)),
                    (tc, _relocated(placements[tc], int(pieces.slot[c]), busiest))]
    return None
