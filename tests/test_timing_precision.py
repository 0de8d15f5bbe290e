"""GPU readiness, the parts a CPU can check: the stopwatch's CUDA-event mode (no synchronize per lap), the dense
precision (planner rate and bf16 autocast), and the one-line error for a multi-node preset without torchrun."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from neocfg.planner.costs import dense_cost
from neocfg.runtime.dlrm import build_dense, dense_autocast
from neocfg.runtime.timing import StepTimes, Stopwatch
from neocfg.types import DensePrecision


def test_cpu_stopwatch_counts_laps_and_subtracts_contained_parts():
    sw = Stopwatch(torch.device("cpu"))
    sw.times = StepTimes()
    sw.span("dense", 1.0, 1.010)
    sw.span("comm_bwd", 2.0, 2.002)
    sw.subtract("dense", "comm_bwd")
    with sw("emb_fwd"):
        pass
    assert sw.times.dense == pytest.approx(8.0) and sw.times.comm_bwd == pytest.approx(2.0)
    assert 0 <= sw.times.emb_fwd < 50


class _FakeEvent:
    """Stands in for torch.cuda.Event: records a fake device clock; elapsed_time only after a synchronize."""

    clock = 0.0
    synced = False

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert _FakeEvent.synced, "an event was read before the device was synchronized"
        return end.t - self.t


def test_cuda_stopwatch_records_events_and_synchronizes_once_at_resolve(monkeypatch):
    syncs = []

    def synchronize():
        syncs.append(1)
        _FakeEvent.synced = True

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    _FakeEvent.synced = False
    sw = Stopwatch(torch.device("cuda", 0))
    steps = []
    for _ in range(3):
        sw.times = StepTimes()
        t0 = sw.now()
        with sw("comm_bwd"):      # 2 fake ms
            sw.now()
        sw.span("dense", t0, sw.now())   # 4 fake ms, of which comm_bwd 2
        sw.subtract("dense", "comm_bwd")
        steps.append(sw.times)
    assert syncs == [] and steps[0].dense == 0.0      # nothing read yet: no synchronize per lap
    sw.resolve()
    assert syncs == [1]
    assert [(s.comm_bwd, s.dense) for s in steps] == [(2.0, 2.0)] * 3


def test_cuda_stopwatch_with_profile_synchronizes_at_every_mark(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    sw = Stopwatch(torch.device("cuda", 0), profile=True)
    sw.times = StepTimes()
    with sw("emb_fwd"):
        pass
    assert len(syncs) == 2 and sw.times.emb_fwd >= 0


def test_planner_dense_rate_follows_dense_precision():
    def fwd_ms(precision: str) -> float:
        cfg = compose_cfg(["hardware=zionex_1node", "model=criteo_kaggle", f"train.dense_precision={precision}",
                           "planner.costs.dense_activation_passes=0"])
        # the GEMM part of the forward, without the fixed per-kernel cost and the activations' passes
        zero = dataclasses.replace(cfg, hardware=dataclasses.replace(
            cfg.hardware, device=dataclasses.replace(cfg.hardware.device, kernel_overhead_us=0.0)))
        return dense_cost(zero).perf.fwd_compute

    hw = compose_cfg(["hardware=zionex_1node"]).hardware.device
    assert fwd_ms("fp32") / fwd_ms("tf32") == pytest.approx(hw.peak_tflops_tf32 / hw.peak_tflops)
    assert fwd_ms("tf32") / fwd_ms("bf16") == pytest.approx(hw.peak_tflops_bf16 / hw.peak_tflops_tf32)
    # cpu_local has no tensor cores: every precision is rated at its fp32 peak
    cpu = compose_cfg(["hardware=cpu_local"]).hardware.device
    assert {cpu.peak_tflops_at(p) for p in DensePrecision} == {cpu.peak_tflops}


def test_bf16_autocast_runs_the_dense_part_in_bfloat16():
    cfg = compose_cfg([])
    dense = build_dense(cfg.model, 0, torch.device("cpu"))
    x = torch.randn(4, cfg.model.num_dense_features)
    pooled = torch.randn(4, sum(cfg.model.embedding_dims))
    with dense_autocast(DensePrecision.bf16, torch.device("cpu")):
        assert dense(x, pooled).dtype is torch.bfloat16
    with dense_autocast(DensePrecision.tf32, torch.device("cpu")):
        assert dense(x, pooled).dtype is torch.float32


def test_multi_node_preset_without_torchrun_says_how_to_launch(cli):
    r = cli("mode=train", "hardware=zionex_2node", "model=dlrm_tiny")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "torchrun --nnodes 2 --nproc-per-node 8" in lines[0] and "hardware=zionex_2node" in lines[0]


def test_cpu_laps_leave_out_the_prefetch_threads_cpu_time():
    """A watched helper thread's CPU time is taken out of the laps it overlapped and counted as the step's prefetch
    lap; the step's total stays its wall time, so the laps add up to it."""
    import threading
    import time

    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            sum(range(2000))

    helper = threading.Thread(target=spin, daemon=True)
    helper.start()
    started.wait()
    sw = Stopwatch(torch.device("cpu"))
    sw.watch_helper(helper.ident)
    assert sw.watching
    sw.times = StepTimes()
    t0 = sw.now()
    with sw("dense"):
        x = 0
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:   # the main thread busy beside the helper, both wanting a core
            x += 1
    sw.span_step(t0, sw.now())
    stop.set()
    helper.join()
    t = sw.times
    assert t.total == pytest.approx(300, rel=0.2)
    assert t.prefetch > 20                                   # the helper ran (the GIL alternates the two)
    assert t.dense == pytest.approx(t.total - t.prefetch, abs=2.0)
    unwatched = Stopwatch(torch.device("cpu"))
    unwatched.times = StepTimes()
    a = unwatched.now()
    unwatched.span_step(a, unwatched.now())
    assert unwatched.times.prefetch == 0.0 and not unwatched.watching


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# How long the test's DDP hook holds each bucket's all-reduce back, seconds: far above a dlrm_tiny step's laps, even
# on a loaded 2-core machine (where a lap of 1 ms now and then takes 100-400).
DDP_DELAY_S = 1.0


def test_ddps_wait_at_the_end_of_backward_is_dense_not_embedding_backward(one_rank_gloo):
    """The emb_bwd lap ends when the last fused TBE has run its backward, not when backward() returns: what
    backward() then waits for (DDP's last all-reduces, here held back by a hook) stays in the dense lap, where the
    estimate prices it (costs.ddp_exposed_ms)."""
    import threading

    from neocfg.data.source import SyntheticSource
    from neocfg.data.synthetic import SyntheticData
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.plans import rule_plan
    from neocfg.runtime.train import Trainer
    from neocfg.types import ShardingType

    b = 8
    cfg = compose_cfg(["model=dlrm_tiny", f"train.batch_size={b}", "train.steps=6", "train.dense_grad_sync=ddp",
                       "train.output_overlap=wait"])
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=b, sharding=ShardingType.table_wise)
    source = SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, b, cycle=3)
    trainer = Trainer(cfg, with_strategies(cfg, plan, source_prefetches=False), None, torch.device("cpu"),
                      source=source)

    def late(_state, bucket):   # one rank: the all-reduced bucket is the bucket, DDP_DELAY_S later, from a thread
        fut = torch.futures.Future()
        threading.Timer(DDP_DELAY_S, fut.set_result, args=(bucket.buffer(),)).start()
        return fut

    trainer.model.register_comm_hook(None, late)
    trainer.train_step()
    _, t = trainer.train_step()
    assert 0 < t.emb_bwd < 1e3 * DDP_DELAY_S / 2, t
    assert t.dense > 1e3 * DDP_DELAY_S * 0.9, t


@pytest.mark.parametrize("twin", [False, True])
def test_the_lookup_backward_note_comes_after_the_fused_update(twin):
    """after_lookup_backward's note (the end of the emb_bwd lap) runs once fbgemm has updated the rows, for the plain
    TBE and for TwinnedTBE (whose output is its lookup's, less the twins' columns), not when the gradient merely
    reaches the module's output."""
    from neocfg.config.train import TrainConfig
    from neocfg.runtime.embedding import after_lookup_backward, make_tbe
    from neocfg.runtime.layout import GroupKey
    from neocfg.tiers import MemoryTier
    from neocfg.types import SparseOptimizer, WeightsDtype

    train = TrainConfig(sparse_optimizer=SparseOptimizer.exact_rowwise_adagrad, sparse_learning_rate=0.5)
    tbe = make_tbe([(50, 8), (30, 4)], GroupKey(WeightsDtype.fp32.value, MemoryTier.hbm.value), train,
                   torch.device("cpu"), twin=twin)
    ids = torch.tensor([1, 7, 7, 3, 2, 9], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 4, 6], dtype=torch.int32)   # 2 tables x 2 bags
    before = [w.clone() for w in tbe.split_embedding_weights()]
    out = tbe(ids, offsets)
    seen = []
    after_lookup_backward(out, lambda: seen.append([w.clone() for w in tbe.split_embedding_weights()]))
    out.sum().backward()
    after = tbe.split_embedding_weights()
    assert len(seen) == 1
    assert not torch.equal(after[0], before[0])                    # the update ran
    assert all(torch.equal(s, a) for s, a in zip(seen[0], after))  # ... before the note
