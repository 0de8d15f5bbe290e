"""Correctness on CUDA (`make gpu-check`): one GPU, world size 1 over NCCL, every memory tier (HBM, UVM with an HBM
cache, UVM only), fp16 weights, the CUDA-event stopwatch and bf16 autocast of the dense part. Every test here is
skipped on a machine without CUDA (CI has none); the CPU-side pieces are tested in tests/test_timing_precision.py.

The reference is the same model trained unsharded in one CPU process (tests/runtime_helpers.py); tolerances are the
CPU correctness tests' (tests/test_runtime_correctness.py), times a small factor for GPU vs CPU summation orders.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from runtime_helpers import _rank_fn, assemble, run_reference, with_train
from neocfg.runtime.launch import launch
from neocfg.runtime.plans import rule_plan
from neocfg.types import Backend, DenseOptimizer, DensePrecision, MemoryTier, SparseOptimizer, WeightsDtype

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")

STEPS, BATCH = 5, 32
LOSS_ATOL = 1e-4          # fp32: GPU and CPU sum in different orders (CPU tests: 1e-5)
WEIGHT_ATOL = 1e-3
FP16_LOSS_ATOL = 2e-3     # fp16 weights, stochastic rounding (CPU tests: 1e-3)
FP16_WEIGHT_ATOL = 2e-3


def _cfg(opt: SparseOptimizer, **train):
    cfg = compose_cfg(["train.batch_size=32", f"train.steps={STEPS}", "train.eval_batches=1", "train.log_every=100",
                       "hardware.devices_per_node=1", "hardware.backend=nccl"])
    dense = DenseOptimizer.sgd if opt is SparseOptimizer.exact_sgd else DenseOptimizer.adagrad
    return with_train(cfg, sparse_optimizer=opt, dense_optimizer=dense, **train)


def _run(jobs):
    (per_rank,) = [launch(_rank_fn, (jobs,), world=1, backend=Backend.nccl, timeout_s=300)]
    return [assemble(cfg, [per_rank[0][j]]) + (per_rank[0][j],) for j, (cfg, _) in enumerate(jobs)]


def _max_diff(a, b) -> float:
    return max(float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("tier", [MemoryTier.hbm, MemoryTier.uvm_caching, MemoryTier.host])
@pytest.mark.parametrize("dtype", [WeightsDtype.fp32, WeightsDtype.fp16])
def test_one_gpu_nccl_equals_the_cpu_reference(tier, dtype):
    opt = SparseOptimizer.exact_sgd if dtype is WeightsDtype.fp16 else SparseOptimizer.exact_rowwise_adagrad
    cfg = _cfg(opt, dense_precision=DensePrecision.fp32)
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=BATCH, memory=tier, weights_dtype=dtype)
    (tables, _, got), = _run([(cfg, plan)])
    ref = run_reference(cfg, 1)
    loss_tol, w_tol = (FP16_LOSS_ATOL, FP16_WEIGHT_ATOL) if dtype is WeightsDtype.fp16 else (LOSS_ATOL, WEIGHT_ATOL)
    assert max(abs(a - b) for a, b in zip(got["losses"], ref.losses)) <= loss_tol
    assert _max_diff(tables, ref.tables) <= w_tol
    init = run_reference(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=0)), 1)
    assert _max_diff(tables, init.tables) > 10 * w_tol, "the tables did not train"
    # CUDA-event times were resolved at the end: every category is a real, non-negative duration
    b = got["metrics"].breakdown_ms
    assert b["total"] > 0 and all(v >= 0 for v in b.values())


def test_bf16_dense_trains_close_to_fp32():
    cfg = _cfg(SparseOptimizer.exact_rowwise_adagrad, dense_precision=DensePrecision.bf16)
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=BATCH)
    (_, _, got), = _run([(cfg, plan)])
    ref = run_reference(cfg, 1)
    # bf16 keeps 8 mantissa bits: losses agree to ~1e-2, not to fp32's 1e-5
    assert max(abs(a - b) for a, b in zip(got["losses"], ref.losses)) <= 3e-2
    assert got["losses"][-1] < got["losses"][0]


def test_profile_synchronizes_and_still_reports_every_category():
    cfg = _cfg(SparseOptimizer.exact_rowwise_adagrad, profile=True)
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=BATCH)
    (_, _, got), = _run([(cfg, plan)])
    b = got["metrics"].breakdown_ms
    assert b["emb_fwd"] > 0 and b["dense"] > 0 and b["total"] >= b["emb_fwd"] + b["dense"] * 0.5
