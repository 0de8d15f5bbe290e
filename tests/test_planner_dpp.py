"""DPP worker sizing (multi-shape least cost, headroom, bottleneck, trainer ingest limit)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from neocfg.config.dsi import WorkerShape
from neocfg.errors import InfeasibleError
from neocfg.planner.dpp import buy_workers, size_dpp, worker_capacity
from neocfg.plan import Estimate

from conftest import compose_cfg
from neocfg.planner import make_plan


def test_worker_capacity_per_resource():
    dsi = compose_cfg(["dsi=prod_like"]).dsi   # 120 us/sample, 4096 B read, 1200 B out
    cap = worker_capacity(dsi, WorkerShape(name="w", cores=64, nic_gbs=3.125, memory_bandwidth_gbs=200.0), 4.0)
    assert cap.cpu == pytest.approx(64e6 / 120)
    assert cap.nic == pytest.approx(3.125e9 / 4096)
    assert cap.memory == pytest.approx(200e9 / (4 * (4096 + 1200)))
    assert cap.samples_per_s == pytest.approx(64e6 / 120) and cap.bottleneck == "cpu"
    slow_nic = worker_capacity(dsi, WorkerShape(name="n", cores=64, nic_gbs=0.1, memory_bandwidth_gbs=200.0), 4.0)
    assert slow_nic.bottleneck == "nic"


def test_least_cost_mix_of_shapes():
    dsi = compose_cfg(["dsi=prod_like"]).dsi
    caps = [worker_capacity(dsi, s, 4.0) for s in dsi.worker_shapes]
    small, big = caps   # small: cost 1, big: cost 2.3 with twice the cores
    need = small.samples_per_s * 3 + 1          # 4 small (cost 4) or 2 big (cost 4.6) or 2 small + 1 big (4.3)
    counts = buy_workers(caps, need)
    assert counts == {small.shape: 4, big.shape: 0}
    cheap_big = [small, dataclasses.replace(big, cost=1.5)]
    counts = buy_workers(cheap_big, need)
    assert counts == {small.shape: 0, big.shape: 2}   # 2 big cost 3.0


def test_headroom_and_report():
    cfg = compose_cfg(["model=dcnv2_mlperf", "hardware=zionex_16node", "dsi=prod_like", "dsi.headroom=0.5"])
    plan = make_plan(cfg)
    d = plan.dpp
    assert d.demand_samples_per_s == pytest.approx(plan.estimate.samples_per_s)
    assert d.capacity_samples_per_s >= 1.5 * d.demand_samples_per_s
    per = 64e6 / 120
    assert d.workers == math.ceil(1.5 * d.demand_samples_per_s / per)
    assert d.workers_per_trainer_node == pytest.approx(d.workers / 16)
    assert d.bottleneck == "cpu (dpp_c64_nic25)"


def test_ingest_limit_is_named():
    cfg = compose_cfg(["model=dcnv2_mlperf", "hardware=zionex_16node", "dsi=prod_like"])
    plan = make_plan(cfg)
    fast = dataclasses.replace(plan, estimate=Estimate(step_ms=0.01, samples_per_s=plan.estimate.samples_per_s * 50))
    with pytest.raises(InfeasibleError, match=r"trainer ingest limit.*dsi.trainer_ingest_gbs=12.5.*would fit with"):
        size_dpp(cfg, fast)
