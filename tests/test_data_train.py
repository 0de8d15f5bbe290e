"""End to end: `neocfg mode=train dsi=parquet_local` trains from the Parquet files through DPP, writes the
data counters into metrics.json, and a run with a rank SIGKILLed mid-way, resumed from its checkpoint, ends with
exactly the parameters of an uninterrupted run (one DPP worker per rank keeps the batch order deterministic).

Skipped when the runtime (mode=train) is not in the build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neocfg.types import Mode

pytestmark = pytest.mark.skipif(not hasattr(Mode, "train"), reason="mode=train (the runtime) is not in this build")

STEPS, EVERY, KILL_AT = 8, 3, 5
DATA = ["dsi=parquet_local", "dsi.path=ds", "dsi.num_samples=4000", "dsi.eval_samples=1000"]
TRAIN = ["mode=train", "dsi=parquet_local", "dsi.path=ds", "dsi.workers=2", "train.batch_size=64",
         f"train.steps={STEPS}", "train.eval_batches=2", "train.log_every=4", "planner.algorithm=greedy",
         f"train.checkpoint_every={EVERY}"]


def _params(root: Path, rank: int) -> dict:
    return torch.load(root / f"step_{STEPS:08d}" / f"rank_{rank}.pt", weights_only=False)


def test_train_from_parquet_and_resume_after_a_killed_rank(cli, tmp_path):
    from neocfg.runtime.train import FAULT_ENV

    r = cli("mode=gen_data", *DATA)
    assert r.returncode == 0, r.stderr
    a, b = tmp_path / "ckpt_a", tmp_path / "ckpt_b"
    r = cli(*TRAIN, f"train.checkpoint_dir={a}")
    assert r.returncode == 0, r.stderr
    m = json.loads(sorted((tmp_path / "outputs").rglob("metrics.json"))[-1].read_text())
    per_rank = m["data_per_rank"]
    assert len(per_rank) == 2
    for d in per_rank:
        assert d["samples_delivered"] == STEPS * 64 and d["duplicate_samples"] == 0
        assert d["dpp.workers"] == 1 and d["dpp.worker_restarts"] == 0 and d["dpp.bytes_read"] > 0
        assert 0.0 <= d["data_stall_fraction"] <= 1.0
    assert m["samples_delivered"] == 2 * STEPS * 64 and m["duplicate_samples"] == 0
    assert m["dpp"]["workers"] == 2 and m["dpp"]["worker_restarts"] == 0 and m["dpp"]["bytes_read"] > 0
    assert 0.0 <= m["data_stall_fraction"] <= 1.0

    r = cli(*TRAIN, f"train.checkpoint_dir={b}", env={FAULT_ENV: f"1:{KILL_AT}"}, timeout=300)
    assert r.returncode != 0
    r = cli(*TRAIN, f"train.checkpoint_dir={b}", "train.resume=true")
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        x, y = _params(a, rank), _params(b, rank)
        for k in x["dense"]:
            assert torch.equal(x["dense"][k], y["dense"][k]), k
        for ex, ey in zip(x["embeddings"], y["embeddings"]):
            assert torch.equal(ex["weights"], ey["weights"])
        assert x["losses"] == y["losses"]


def test_train_from_parquet_learns(cli, tmp_path):
    r = cli("mode=gen_data", "dsi=parquet_local", "dsi.path=ds", "dsi.num_samples=32768", "dsi.eval_samples=2048")
    assert r.returncode == 0, r.stderr
    # 100 steps x 128 x 2 ranks = 25,600 samples: less than one pass (DLRMs overfit on a second one).
    r = cli("mode=train", "dsi=parquet_local", "dsi.path=ds", "train.steps=100", "train.batch_size=128",
            "train.eval_batches=4", "planner.algorithm=greedy")
    assert r.returncode == 0, r.stderr
    m = json.loads(sorted((tmp_path / "outputs").rglob("metrics.json"))[-1].read_text())
    assert m["final_loss_mean_last_10"] < m["initial_loss"] and m["eval_auc"] > 0.65


def test_prod_like_trains_through_dpp_with_the_planned_worker_hosts(cli, tmp_path):
    """dsi=prod_like reads Parquet through DPP; the planner's worker hosts become local worker processes per rank,
    and the run says how."""
    r = cli("mode=gen_data", "dsi=prod_like", "dsi.num_samples=3000", "dsi.eval_samples=500")
    assert r.returncode == 0, r.stderr
    r = cli("mode=train", "dsi=prod_like", "train.steps=3", "train.batch_size=64", "train.eval_batches=1",
            "planner.algorithm=greedy")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("DPP: the plan sizes")]
    assert len(said) == 1 and "dpp_c64_nic25 worker host(s)" in said[0] and "local worker processes per rank" in \
        said[0], r.stdout
    # No DPP warning. A 3-step run's timing on a shared machine may be far off the estimate; that warning is allowed.
    warned = [line for line in r.stdout.splitlines() if "warning" in line and "off the estimate" not in line]
    assert not warned, r.stdout
    m = json.loads(sorted((tmp_path / "outputs").rglob("metrics.json"))[-1].read_text())
    assert all(d["dpp.workers_source"] == "planner" for d in m["data_per_rank"])
    assert m["duplicate_samples"] == 0 and m["samples_delivered"] == 2 * 3 * 64
