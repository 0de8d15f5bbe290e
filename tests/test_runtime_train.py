"""Through the real CLI: mode=train trains and writes metrics.json; checkpoints are atomic and a run with a
rank killed mid-way, resumed, ends with exactly the parameters of an uninterrupted run; another plan's checkpoint
is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import compose_cfg
from runtime_helpers import assert_same_rank_state
from neocfg.runtime.plans import rule_plan
from neocfg.runtime.train import FAULT_ENV
from neocfg.types import ShardingType as S, WeightsDtype

STEPS, EVERY, KILL_AT = 8, 3, 5
COMMON = ["mode=train", "train.batch_size=64", f"train.steps={STEPS}", "train.eval_batches=2", "train.log_every=4"]
MIXED = [S.table_wise, S.row_wise, S.data_parallel, S.column_wise, S.row_wise, S.table_wise, S.table_row_wise,
         S.data_parallel]


def _plan_file(tmp_path: Path, sharding, weights_dtype: WeightsDtype = WeightsDtype.fp32) -> Path:
    cfg = compose_cfg(COMMON)
    if isinstance(sharding, list):
        sharding = {t.name: s for t, s in zip(cfg.model.tables, sharding)}
    path = tmp_path / f"plan_{len(list(tmp_path.glob('plan_*')))}.json"
    rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=sharding, step_ms=10.0,
              weights_dtype=weights_dtype).save(path)
    return path


def _metrics(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "outputs").rglob("metrics.json"))


def test_train_writes_metrics(cli, tmp_path):
    plan = _plan_file(tmp_path, MIXED)
    r = cli(*COMMON, "train.steps=60", f"planner.plan_file={plan}")
    assert r.returncode == 0, r.stderr
    assert "metrics.json" in r.stdout and "prediction error" in r.stdout and "data stall: " in r.stdout
    m = json.loads(_metrics(tmp_path)[-1].read_text())
    for key in ("steps", "samples", "samples_per_s", "initial_loss", "final_loss", "eval_auc", "eval_ne",
                "breakdown_ms", "predicted_step_ms", "measured_step_ms", "prediction_error"):
        assert key in m, key
    assert m["steps"] == 60 and m["samples"] == 60 * 64 * 2
    assert m["final_loss_mean_last_10"] < m["initial_loss"]
    assert m["eval_auc"] > 0.6 and m["eval_ne"] < 1.0
    assert m["predicted_step_ms"] == 10.0 and m["measured_step_ms"] > 0
    # the data-parallel tables' backward has laps of its own (out of "dense"), beside the planner's terms for it
    assert m["breakdown_ms"]["dp_update"] > 0 and m["breakdown_ms"]["comm_dp"] > 0
    assert m["predicted_vs_measured_ms"]["dp_all_reduce"][1] == m["breakdown_ms"]["comm_dp"]
    assert m["predicted_vs_measured_ms"]["dp_all_reduce"][0] > 0
    # The synthetic source has no stall clock of its own: the stall is the measured data wait over the step time.
    assert 0.0 <= m["data_stall_fraction"] < 1.0 and m["samples_delivered"] == 60 * 64 * 2
    assert m["duplicate_samples"] == 0 and m["dpp"]["workers"] == 0


def _final_state(root: Path) -> dict[int, dict]:
    step = root / f"step_{STEPS:08d}"
    return {r: torch.load(step / f"rank_{r}.pt", weights_only=False) for r in range(2)}


@pytest.mark.parametrize("fault,weights", [(f"1:{KILL_AT}", WeightsDtype.fp32),
                                           (f"1:{2 * EVERY}:save", WeightsDtype.fp32),
                                           (f"0:{KILL_AT}", WeightsDtype.fp16)],
                         ids=["mid_run", "mid_checkpoint", "mid_run_fp16_weights"])
def test_killed_rank_resume_equals_uninterrupted(cli, tmp_path, fault, weights):
    """Bit-identical final state, fp16 weights with stochastic rounding included; killing rank 0 or rank 1."""
    plan = _plan_file(tmp_path, MIXED, weights)
    a, b = tmp_path / "ckpt_a", tmp_path / "ckpt_b"
    args = [*COMMON, f"planner.plan_file={plan}", f"train.checkpoint_every={EVERY}"]
    r = cli(*args, f"train.checkpoint_dir={a}")
    assert r.returncode == 0, r.stderr

    r = cli(*args, f"train.checkpoint_dir={b}", env={FAULT_ENV: fault}, timeout=300)
    assert r.returncode != 0
    assert f"rank {fault[0]} was killed by SIGKILL" in r.stderr, r.stderr
    # the last complete checkpoint survives (a half-written one is never pointed at)
    assert (b / "latest").read_text().strip() == f"step_{EVERY:08d}"

    r = cli(*args, f"train.checkpoint_dir={b}", "train.resume=true")
    assert r.returncode == 0, r.stderr
    m = json.loads(_metrics(tmp_path)[-1].read_text())
    assert m["resumed_from_step"] == EVERY and m["steps_this_run"] == STEPS - EVERY
    assert f"neocfg: resuming from step {EVERY} of {STEPS}" in r.stdout              # the console says so
    assert f"{STEPS} steps (resumed from step {EVERY}: {STEPS - EVERY} steps in this run)" in r.stdout

    sa, sb = _final_state(a), _final_state(b)
    for rank in range(2):
        assert sa[rank]["step"] == STEPS
        assert_same_rank_state(sa[rank], sb[rank])


def test_checkpoint_of_another_plan_is_refused(cli, tmp_path):
    plan_tw, plan_mixed = _plan_file(tmp_path, S.table_wise), _plan_file(tmp_path, MIXED)
    ckpt = tmp_path / "ckpt"
    r = cli(*COMMON, "train.steps=3", f"planner.plan_file={plan_tw}", "train.checkpoint_every=3",
            f"train.checkpoint_dir={ckpt}")
    assert r.returncode == 0, r.stderr
    r = cli(*COMMON, "train.steps=6", f"planner.plan_file={plan_mixed}", f"train.checkpoint_dir={ckpt}",
            "train.resume=true")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "different plan" in err[0] and "Traceback" not in r.stderr, r.stderr


def test_a_rank_that_stops_responding_fails_the_job(cli, tmp_path):
    plan = _plan_file(tmp_path, MIXED)
    r = cli(*COMMON, f"planner.plan_file={plan}", "train.collective_timeout_s=5", env={FAULT_ENV: "1:3:hang"},
            timeout=120)
    assert r.returncode == 6, r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line or "Traceback" in line]
    assert len(err) == 1 and err[0].startswith("neocfg: error: rank 0: a collective failed (Timed out")
    assert "stopped responding" in err[0]


def test_resume_needs_checkpoint_dir(cli):
    r = cli("mode=train", "train.resume=true")
    assert r.returncode == 2 and "train.checkpoint_dir" in r.stderr


@pytest.mark.parametrize("hardware", [[], ["hardware=zionex_1node", "hardware.devices_per_node=2"]])
def test_under_torchrun(tmp_path, hardware):
    """torchrun starts the processes; neocfg joins its group and rank 0's plan is the one trained. A GPU (nccl)
    preset on a machine without CUDA trains on gloo CPU ranks."""
    import subprocess
    import sys

    import torch

    if hardware and torch.cuda.is_available():
        pytest.skip("the gloo fallback is for machines without CUDA")
    plan = _plan_file(tmp_path, MIXED)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "neocfg",
                        *COMMON, *hardware, f"planner.plan_file={plan}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # fbgemm's ~50 INFO lines per process (through the root logger Hydra sets to INFO) are filtered out
    assert "Successfully loaded" not in r.stdout + r.stderr and "TBE=" not in r.stdout + r.stderr
    metrics = _metrics(tmp_path)
    assert len(metrics) == 1  # only rank 0 reports
    m = json.loads(metrics[0].read_text())
    assert m["world_size"] == 2 and m["steps"] == STEPS


def test_diverging_run_stops_with_one_line(cli, tmp_path):
    """Learning rates of 1000 blow the loss up within a few steps: the whole `mode=train` process stops at the first
    check after it with one line naming the step and the loss, exit code 9, and keeps the checkpoints it completed
    before (none of a diverged state)."""
    import re

    plan = _plan_file(tmp_path, MIXED)
    ckpt = tmp_path / "ckpt"
    r = cli(*COMMON, "train.steps=40", f"planner.plan_file={plan}", "train.dense_learning_rate=1000",
            "train.sparse_learning_rate=1000", "train.checkpoint_every=1", f"train.checkpoint_dir={ckpt}",
            timeout=300)
    assert r.returncode == 9, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("neocfg:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    m = re.search(r"training diverged at step (\d+): loss (\S+) ", lines[0])
    assert m is not None, lines[0]
    step, loss = int(m.group(1)), float(m.group(2))
    assert step >= 2 and (loss != loss or loss > 10 * 0.69), lines[0]   # NaN, or 10x a first log loss near 0.69
    saved = sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*"))
    assert saved and max(saved) == step - 1, saved
    assert not _metrics(tmp_path)


def test_divergence_check_names_the_first_bad_step():
    from neocfg.errors import DivergedError
    from neocfg.runtime.train import check_divergence

    check_divergence([0.69, 0.7, 6.0, 0.5], 0, 10.0)                        # below 10x the first loss: trains on
    with pytest.raises(DivergedError, match="at step 3: loss 7"):
        check_divergence([0.69, 0.7, 7.0, 1e9], 1, 10.0)
    with pytest.raises(DivergedError, match="at step 2: loss nan is not finite"):
        check_divergence([0.69, float("nan")], 1, 10.0)
    check_divergence([0.69, 1e9], 2, 10.0)                                   # steps already checked: not again
