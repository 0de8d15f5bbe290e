"""DPP sizing (DSI/DPP, ISCA'22): how many preprocessing workers of which shapes feed the trainers.

Demand: the plan's samples/s (global batch / step time). Per worker shape, the samples/s each resource can carry:
  cpu      cores x 1e6 / preprocess_cpu_us_per_sample
  nic      nic_gbs x 1e9 / max(bytes read from storage, tensor bytes sent)   (the NIC is full duplex)
  memory   memory_bandwidth_gbs x 1e9 / (dpp_memory_passes x (bytes read + tensor bytes))
a worker's capacity is the least of them (its bottleneck). A small integer program buys workers of each shape at the
least total cost whose capacity meets demand x (1 + headroom). A trainer host that cannot ingest its share of the
tensors (dsi.trainer_ingest_gbs) makes the plan infeasible.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pulp

from neocfg.config.dsi import DsiConfig, WorkerShape
from neocfg.config.schema import NeocfgConfig
from neocfg.errors import IngestLimitError
from neocfg.plan import DppSizing, Plan
from neocfg.planner import cbc

_DPP_TIME_LIMIT_S = 5


@dataclass(frozen=True)
class WorkerCapacity:
    shape: str
    cost: float
    cpu: float
    nic: float
    memory: float

    @property
    def samples_per_s(self) -> float:
        return min(self.cpu, self.nic, self.memory)

    @property
    def bottleneck(self) -> str:
        caps = {"cpu": self.cpu, "nic": self.nic, "memory_bandwidth": self.memory}
        return min(caps, key=caps.get)


def worker_capacity(dsi: DsiConfig, shape: WorkerShape, memory_passes: float) -> WorkerCapacity:
    return WorkerCapacity(
        shape=shape.name, cost=shape.cost,
        cpu=shape.cores * 1e6 / dsi.preprocess_cpu_us_per_sample,
        nic=shape.nic_gbs * 1e9 / max(dsi.bytes_read_per_sample, dsi.tensor_bytes_per_sample),
        memory=shape.memory_bandwidth_gbs * 1e9 / (memory_passes * (dsi.bytes_read_per_sample
                                                                    + dsi.tensor_bytes_per_sample)))


def check_ingest(cfg: NeocfgConfig, demand: float) -> None:
    hw, dsi = cfg.hardware, cfg.dsi
    per_node = demand / hw.nodes * dsi.tensor_bytes_per_sample / 1e9
    if per_node > dsi.trainer_ingest_gbs:
        nodes = math.ceil(hw.nodes * per_node / dsi.trainer_ingest_gbs)
        raise IngestLimitError(
            f"trainer ingest limit: each trainer node must receive {per_node:,.2f} GB/s of preprocessed tensors"
            f" ({demand / hw.nodes:,.0f} samples/s x {dsi.tensor_bytes_per_sample:,.0f} B) but"
            f" dsi.trainer_ingest_gbs={dsi.trainer_ingest_gbs:g}; would fit with dsi.trainer_ingest_gbs>="
            f"{per_node:.2f}, smaller tensors per sample, a smaller train.batch_size or hardware.nodes>={nodes}"
            f" at the same global throughput")


def buy_workers(caps: list[WorkerCapacity], need: float) -> dict[str, int]:
    """Least-cost integer mix of worker shapes with total capacity >= need (samples/s)."""
    prob = pulp.LpProblem("neocfg_dpp", pulp.LpMinimize)
    n = {c.shape: cbc.var(prob, f"n_{i}", cat="Integer", low=0) for i, c in enumerate(caps)}
    prob += pulp.lpSum(c.cost * n[c.shape] for c in caps)
    prob += pulp.lpSum(c.samples_per_s * n[c.shape] for c in caps) >= need
    out = cbc.solve(prob, _DPP_TIME_LIMIT_S, 0.0, warm=False)
    if out.objective is None:  # cannot happen for a covering problem with positive capacities; be safe
        best = min(caps, key=lambda c: c.cost / c.samples_per_s)
        return {best.shape: math.ceil(need / best.samples_per_s)}
    return {s: int(round(v.value() or 0)) for s, v in n.items()}


def size_dpp(cfg: NeocfgConfig, plan: Plan) -> Plan:
    dsi = cfg.dsi
    demand = plan.estimate.samples_per_s
    check_ingest(cfg, demand)
    caps = [worker_capacity(dsi, s, cfg.planner.costs.dpp_memory_passes) for s in dsi.worker_shapes]
    counts = buy_workers(caps, demand * (1 + dsi.headroom))
    workers = sum(counts.values())
    capacity = sum(c.samples_per_s * counts[c.shape] for c in caps)
    main = max(caps, key=lambda c: counts[c.shape] * c.samples_per_s)
    sizing = DppSizing(workers=workers, workers_per_trainer_node=workers / plan.nodes,
                       bottleneck=f"{main.bottleneck} ({main.shape})", demand_samples_per_s=demand,
                       capacity_samples_per_s=capacity, workers_by_shape={k: v for k, v in counts.items() if v})
    return dataclasses.replace(plan, dpp=sizing)
