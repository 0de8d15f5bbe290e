"""metrics.json is one typed record (neocfg.run_metrics.RunMetrics): written from it, printed from it, and read back
into it by the sweep summary."""

from __future__ import annotations

import json

import pytest
import yaml

from neocfg.errors import DataError
from neocfg.run_metrics import DppCounters, RunMetrics, TermMs, render
from neocfg.sweep.summary import read_run


def record(**changes) -> RunMetrics:
    base = dict(
        model="dlrm_tiny", world_size=2, batch_size_per_rank=64, global_batch=128, steps=10, steps_this_run=10,
        resumed_from_step=None, samples=1280, samples_per_s=9876.5, wall_s=1.5, checkpoint_s=0.0,
        initial_loss=0.69, final_loss=0.5, final_loss_mean_last_10=0.55, losses=[0.69, 0.5], max_loss=0.69,
        max_loss_step=1, eval_samples=256,
        eval_logloss=0.6, eval_ne=0.9, eval_auc=0.71, eval_ctr=0.4,
        breakdown_ms={"data_wait": 0.1, "comm_input": 1.0, "emb_fwd": 2.0, "comm_fwd": 1.5, "dense": 3.0,
                      "dp_update": 0.0, "comm_dp": 0.0, "comm_bwd": 1.25, "emb_bwd": 2.5, "total": 11.35},
        breakdown_ms_per_rank=[{"total": 11.3}, {"total": 11.4}], timed_steps=8, warmup_steps=2,
        predicted_step_ms=10.0, measured_step_ms=12.5, plan_batch_size_per_device=64,
        predicted_vs_measured_ms={"embedding_compute": TermMs(4.0, 4.5), "dense": TermMs(3.5, 3.0)},
        prediction_error=0.25, a2a_fwd_dtype="fp32", a2a_bwd_dtype="fp32", sparse_optimizer="exact_rowwise_adagrad",
        dense_optimizer="adagrad", plan_solver="ilp", data={"samples_delivered": 1280}, data_per_rank=[{}, {}],
        data_stall_fraction=0.01, samples_delivered=1280, duplicate_samples=0, dpp=DppCounters(workers=3))
    base.update(changes)
    return RunMetrics(**base)


def test_json_round_trip_keeps_the_file_format(tmp_path):
    m = record()
    m.save(tmp_path / "metrics.json")
    raw = json.loads((tmp_path / "metrics.json").read_text())
    # the contract's shapes: terms as [predicted, measured] pairs, dpp counters as an object
    assert raw["predicted_vs_measured_ms"]["embedding_compute"] == [4.0, 4.5]
    assert raw["dpp"] == {"backend": None, "workers": 3, "worker_restarts": 0, "bytes_read": 0}
    assert RunMetrics.load(tmp_path / "metrics.json") == m
    assert m.predicted_vs_measured_ms["dense"].ratio == pytest.approx(3.5 / 3.0)


def test_a_broken_metrics_file_is_one_line(tmp_path):
    path = tmp_path / "metrics.json"
    raw = record().to_dict()
    del raw["measured_step_ms"]
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError, match="not a valid neocfg metrics.json"):
        RunMetrics.load(path)


def test_the_summary_is_printed_from_the_record():
    text = render(record())
    assert "trained dlrm_tiny on 2 ranks: 10 steps, 1,280 samples, 9,876 samples/s" in text
    assert "predicted 10.00 ms, measured 12.50 ms (prediction error +25%)" in text
    assert "embedding_compute 4.00 / 4.50, dense 3.50 / 3.00" in text
    assert "loss 0.69 (step 1) -> 0.5 (step 10); mean of the last 10 steps 0.55" in text
    assert "highest 0.9 at step 4;" in render(record(max_loss=0.9, max_loss_step=4))
    assert "dp_update" not in text and "comm_bwd 1.25" in text      # no replicas: their laps are left out
    assert "the plan was made for batch" not in text
    assert "the plan was made for batch 256 per device, this run used 64" in render(
        record(plan_batch_size_per_device=256))
    assert "step breakdown: not measured" in render(record(timed_steps=0))


def test_the_sweep_summary_reads_the_record(tmp_path):
    run = tmp_path / "3"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["train.batch_size=64"]))
    (run / "status.json").write_text(json.dumps({"ok": True}))
    record().save(run / "metrics.json")
    row = read_run(run)
    assert row.fits and row.metrics["measured_step_ms"] == 12.5 and row.metrics["measured_samples_per_s"] == 9876.5
    assert row.metrics["final_loss"] == 0.5 and row.metrics["eval_auc"] == 0.71
    (run / "metrics.json").write_text("{}")     # unreadable: the row stays, without measurements
    assert read_run(run).metrics["measured_step_ms"] is None
