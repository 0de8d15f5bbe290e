"""Small pieces of the runtime: metrics, shard geometry, layout kinds, deterministic shard init."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import compose_cfg
from neocfg.runtime.embedding import init_rows
from neocfg.runtime.layout import OutputKind, build_layout
from neocfg.runtime.metrics import auc, evaluate
from neocfg.runtime.plans import rule_plan
from neocfg.types import ShardingType as S


def test_auc_known_values():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(torch.tensor([1.0, 2.0]), torch.tensor([0, 1])) == 1.0
    assert auc(torch.tensor([5.0, 5.0, 5.0, 5.0]), torch.tensor([0, 1, 0, 1])) == pytest.approx(0.5)  # ties
    g = torch.Generator().manual_seed(0)
    s, y = torch.randn(20000, generator=g), (torch.rand(20000, generator=g) < 0.5).float()
    assert auc(s, y) == pytest.approx(0.5, abs=0.02)


def test_normalized_entropy_of_the_base_rate_is_one():
    y = torch.tensor([0.0, 1.0, 0.0, 0.0])
    m = evaluate(torch.full((4,), math.log(0.25 / 0.75)), y)
    assert m.ne == pytest.approx(1.0) and m.ctr == 0.25


def test_init_is_the_same_however_a_table_is_cut():
    full = init_rows(7, 2, 10000, 16, 0, 10000)
    assert torch.equal(init_rows(7, 2, 10000, 16, 4000, 5000, 4, 8), full[4000:9000, 4:12])
    assert full.abs().max() <= 10000 ** -0.5


def test_layout_kinds():
    cfg = compose_cfg([])
    names = [t.name for t in cfg.model.tables]
    mix = dict(zip(names, [S.table_wise, S.column_wise, S.row_wise, S.table_row_wise, S.data_parallel,
                           S.table_wise, S.table_wise, S.table_wise]))
    plan = rule_plan(cfg.model, world=4, devices_per_node=2, batch_size=8, sharding=mix)
    lay = build_layout(plan, cfg.model, 0)
    assert lay.kinds[:5] == [OutputKind.all_to_all, OutputKind.all_to_all, OutputKind.reduce_scatter,
                             OutputKind.hierarchical, OutputKind.replicated]
    assert lay.table_node == {3: 1}  # rule plans put TWRW table i on node i mod nodes
    assert lay.hierarchical_widths() == [0, 16]
    # every rank holds one RW row range in its TBE groups; the DP replica lives apart (neocfg.runtime.replicated)
    for r in lay.ranks:
        tables = [s.table for s in r.features]
        assert 2 in tables and 4 not in tables
    assert lay.tables_of(OutputKind.replicated) == [4]


def test_data_stats_aggregate_fractions_by_mean_and_counters_by_sum():
    from neocfg.runtime.train import aggregate_data_stats

    agg = aggregate_data_stats([
        {"data_stall_fraction": 0.1, "samples_delivered": 100, "dpp.workers": 2, "dpp.workers_source": "plan"},
        {"data_stall_fraction": 0.3, "samples_delivered": 50, "dpp.workers": 1, "dpp.workers_source": "plan"},
    ])
    assert agg == {"data_stall_fraction": pytest.approx(0.2), "samples_delivered": 150, "dpp.workers": 3}


def test_measured_data_term_is_the_production_per_step_and_rank():
    """metrics.json's "data" pair: what producing the batches took per step and rank (the prefetching source's
    own clock, summed over ranks), else the time the step waited for them."""
    from neocfg.runtime.train import produce_ms

    assert produce_ms({"data_produce_seconds": 0.6}, {"data_wait": 0.1}, world=2, steps=100) == pytest.approx(3.0)
    assert produce_ms({}, {"data_wait": 0.25}, world=2, steps=100) == 0.25


def test_predicted_embedding_terms_leave_out_the_dense_part():
    from neocfg.plan import DeviceEstimate, Estimate

    devices = (DeviceEstimate(rank=0, hbm_bytes=0, host_bytes=0, compute_ms=5.0, comm_ms=3.0, total_ms=8.0),
               DeviceEstimate(rank=1, hbm_bytes=0, host_bytes=0, compute_ms=6.0, comm_ms=2.5, total_ms=8.5))
    est = Estimate(step_ms=8.5, samples_per_s=1.0, dense_ms=3.0, dense_compute_ms=2.0, dense_comm_ms=1.0)
    assert est.embedding_terms_ms(devices) == (4.0, 2.0)



_HEAP_AFTER_FREE = """
import ctypes, sys, torch
from neocfg.runtime.launch import keep_freed_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
mapped = libc.mallinfo2().hblkhd
n = int(sys.argv[2])
x = torch.ones(n, dtype=torch.long)
mapped = libc.mallinfo2().hblkhd - mapped
del x
print(mapped >> 20, libc.mallinfo2().fordblks >> 20)   # MB mmap'd for it; MB free in the heap once it is freed
"""


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("mb", [24, 56])   # a routing step's payload; a row-wise pooled output above glibc's 32 MB
def test_freed_memory_stays_in_the_heap(keep, mb):
    """keep_freed_memory: a large tensor comes from the heap and stays there once freed, ready for the next step
    (glibc's default mmaps it and unmaps it on free, so the next step faults its pages in again)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HEAP_AFTER_FREE, "keep" if keep else "default",
                          str((mb << 20) // 8)], check=True, capture_output=True, text=True).stdout
    mapped_mb, free_in_heap_mb = (int(x) for x in out.split()[-2:])
    if keep:
        assert mapped_mb == 0 and free_in_heap_mb >= mb - 2, out
    else:
        assert mapped_mb >= mb - 2 and free_in_heap_mb < mb - 2, out


def test_console_names_the_stall_the_resume_step_and_the_term_furthest_off():
    import dataclasses

    from neocfg.run_metrics import RunMetrics, TermMs, render

    m = RunMetrics(
        model="m", world_size=2, batch_size_per_rank=64, global_batch=128, steps=50, steps_this_run=20,
        resumed_from_step=30, samples=6400, samples_per_s=1000.0, wall_s=1.0, checkpoint_s=0.0, initial_loss=0.69,
        final_loss=0.5, final_loss_mean_last_10=0.51, losses=[0.69, 0.5], max_loss=0.7, max_loss_step=2,
        eval_samples=0, eval_logloss=None, eval_ne=None, eval_auc=None, eval_ctr=None,
        breakdown_ms={"data_wait": 3.0, "total": 20.0}, breakdown_ms_per_rank=[], timed_steps=10, warmup_steps=2,
        predicted_step_ms=10.0, measured_step_ms=20.0, plan_batch_size_per_device=64,
        predicted_vs_measured_ms={"embedding_compute": TermMs(2.0, 3.0), "embedding_comm": TermMs(3.0, 11.0),
                                  "dense": TermMs(4.0, 1.0), "data": TermMs(1.0, 1.0)},
        prediction_error=1.0, a2a_fwd_dtype="fp32", a2a_bwd_dtype="fp32", sparse_optimizer="x", dense_optimizer="y",
        plan_solver="ilp", data={}, data_per_rank=[], data_stall_fraction=0.15, samples_delivered=0,
        duplicate_samples=0)
    text = render(m)
    assert "50 steps (resumed from step 30: 20 steps in this run)" in text
    assert "data stall: 15.0% of the step" in text
    assert ("neocfg: warning: the measured step (20.00 ms) is +100% off the estimate (10.00 ms); the term furthest"
            " off: embedding_comm, predicted 3.00 ms, measured 11.00 ms (+8.00 ms)") in text
    m = dataclasses.replace(m, measured_step_ms=14.0, prediction_error=0.4)
    assert "warning" not in render(m)   # within 50% of the estimate: no warning
