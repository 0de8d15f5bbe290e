"""How many DPP workers a service starts: `dsi.workers` fixed, or `auto` from the planner's DPP sizing.

The planner sizes DPP in worker *hosts* of a shape (e.g. 2 x cpu_host_64c); the runtime hands that sizing to the data
layer as a PlannedDpp (the data layer never calls the planner). The backends turn hosts into what they run:
  ray    one worker actor per planned host, with the host's CPUs and memory (scaled down where the cluster is
         smaller: neocfg/data/dpp/ray_backend.py); one job-wide service
  local  one worker process per planned core, over the trainer ranks (one service per rank), at most
         dsi.max_workers and this machine's cores per rank
Without a sizing (no plan, or a plan without DPP) `auto` estimates one worker per trainer rank plus dsi.headroom.
The conversion is said in one line; a fixed dsi.workers beyond what is possible is capped with a warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from neocfg.config.dsi import DsiConfig
from neocfg.plan import DppSizing
from neocfg.data.dpp.backends import backend_of
from neocfg.types import DppBackendKind


class WorkerCountSource(Enum):
    fixed = "fixed"            # dsi.workers=<n>
    planner = "planner"        # Plan.dpp (hosts of a worker shape)
    estimate = "estimate"      # no DPP sizing available: ceil(world * (1 + headroom))


@dataclass(frozen=True)
class PlannedDpp:
    """The planner's DPP sizing as the runtime hands it to the data layer: worker hosts and what one host has."""

    hosts: int
    shape: str
    cores_per_host: float
    memory_gib_per_host: float

    @staticmethod
    def from_plan(dpp: Optional[DppSizing], dsi: DsiConfig) -> Optional["PlannedDpp"]:
        if dpp is None or dpp.workers < 1:
            return None
        shapes = {s.name: s for s in dsi.worker_shapes}
        bought = {k: v for k, v in dpp.workers_by_shape.items() if v and k in shapes} or \
            {dsi.worker_shapes[0].name: dpp.workers}
        hosts = sum(bought.values())
        return PlannedDpp(hosts=hosts, shape=" + ".join(f"{n} x {k}" for k, n in bought.items()),
                          cores_per_host=sum(shapes[k].cores * n for k, n in bought.items()) / hosts,
                          memory_gib_per_host=sum(shapes[k].memory_gib * n for k, n in bought.items()) / hosts)


@dataclass(frozen=True)
class WorkerCount:
    total: int            # workers of the job
    per_service: int      # workers one service starts (per rank: local; the job's: ray)
    source: WorkerCountSource
    note: str = ""        # the conversion, said once
    warning: str = ""     # set when the request was capped


def worker_count(dsi: DsiConfig, world_size: int, sizing: Optional[PlannedDpp] = None,
                 backend: Optional[DppBackendKind] = None, *, cpus: int,
                 ranks_per_host: Optional[int] = None) -> WorkerCount:
    """cpus: one trainer host's cores (hardware.host.cpu_cores), which the local worker processes of its ranks
    (ranks_per_host, default every rank: hardware.devices_per_node) share."""
    backend = backend or dsi.backend
    job_wide = backend_of(backend).job_wide
    cap = dsi.max_workers
    if dsi.workers != "auto":
        total = int(dsi.workers)
        want = total if job_wide else math.ceil(total / world_size)
        per = min(want, cap)
        where = "worker actors for the job" if job_wide else f"worker processes per rank ({total} over {world_size} ranks)"
        warning = (f"warning: dsi.workers={total} asks for {want} {where}; capped at dsi.max_workers={cap}"
                   if want > cap else "")
        return WorkerCount(total=total, per_service=per, source=WorkerCountSource.fixed, warning=warning)
    if sizing is None:
        total = math.ceil(world_size * (1.0 + dsi.headroom))
        per = total if job_wide else math.ceil(total / world_size)
        return WorkerCount(total=total, per_service=min(per, cap), source=WorkerCountSource.estimate,
                           note=f"DPP: no planned sizing; {total} workers (one per trainer rank + dsi.headroom "
                                f"{dsi.headroom:g})")
    if job_wide:
        per = min(sizing.hosts, cap)
        capped = f", at most dsi.max_workers={cap}" if sizing.hosts > cap else ""
        return WorkerCount(total=sizing.hosts, per_service=per, source=WorkerCountSource.planner,
                           note=f"DPP: the plan sizes {sizing.shape} worker host(s) -> {per} Ray worker actor(s) of "
                                f"{sizing.cores_per_host:g} CPUs each{capped}")
    processes = max(1, math.ceil(sizing.hosts * sizing.cores_per_host))
    want = math.ceil(processes / world_size)
    local = ranks_per_host or world_size
    fit = min(cap, max(1, cpus // local))
    per = min(want, fit)
    why = "" if per == want else (f" (hardware.host.cpu_cores={cpus} for {local} ranks per host)"
                                  if fit < cap else f" (at most dsi.max_workers={cap})")
    return WorkerCount(total=processes, per_service=per, source=WorkerCountSource.planner,
                       note=f"DPP: the plan sizes {sizing.shape} worker host(s), {processes} cores -> {want} local "
                            f"worker processes per rank over {world_size} ranks; running {per} per rank{why}")


def workers_needed(demand_samples_per_s: float, per_worker_samples_per_s: float, headroom: float) -> int:
    """Workers that meet a trainer demand with `headroom` spare: ceil(demand * (1 + headroom) / per-worker rate)."""
    return max(1, math.ceil(demand_samples_per_s * (1.0 + headroom) / per_worker_samples_per_s))
