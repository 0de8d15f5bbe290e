"""Multirun sweeps end with sweep_summary.{csv,md,png}; a run that fails is a row saying why."""

from __future__ import annotations

import csv
from pathlib import Path


def _sweep_dir(tmp_path: Path) -> Path:
    dirs = [p.parent for p in (tmp_path / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


def test_describe_sweep_with_a_bad_run_is_summarized(cli, tmp_path):
    r = cli("-m", "mode=describe", "hardware=zionex_1node", "hardware.nodes=1,0,2")
    assert r.returncode == 0, r.stderr
    sweep = _sweep_dir(tmp_path)
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"):
        assert (sweep / name).stat().st_size > 0
    rows = _rows(sweep)
    assert [row["hardware.nodes"] for row in rows] == ["1", "0", "2"]
    assert [row["fits"] for row in rows] == ["yes", "no", "yes"]
    assert "hardware.nodes=0 is invalid: must be > 0" in rows[1]["why"]
    assert "hardware" not in rows[0]  # not swept: the same in every run
    md = (sweep / "sweep_summary.md").read_text()
    assert md.startswith("| job | hardware.nodes | fits | why |")


def test_plan_sweep_rows_carry_plan_metrics_and_infeasible_reason(cli, tmp_path):
    r = cli("-m", "mode=plan", "model=dlrm_tiny", "hardware=zionex_1node", "planner.algorithm=ilp,greedy",
            "hardware.device.hbm_gib=40,0.0001", "sweep.metric=gap",
            "dsi.trainer_ingest_gbs=1000")
    assert r.returncode == 0, r.stderr
    sweep = _sweep_dir(tmp_path)
    rows = _rows(sweep)
    assert len(rows) == 4
    for row in rows:
        fits = row["hardware.device.hbm_gib"] == "40"
        assert row["fits"] == ("yes" if fits else "no"), row
        if fits:
            assert float(row["step_ms"]) > 0 and float(row["samples_per_s"]) > 0
            assert 0 <= float(row["gap"]) <= 1 and float(row["lower_bound_ms"]) <= float(row["objective_ms"]) + 1e-9
            assert int(row["dpp_workers"]) >= 1 and 0 < float(row["max_hbm_pct"]) <= 100
        else:
            assert "does not fit" in row["why"] and row["step_ms"] == ""
    assert {row["planner.algorithm"] for row in rows} == {"ilp", "greedy"}
    assert (sweep / "sweep_summary.png").stat().st_size > 0
    assert "sweep: 4 runs (2 did not fit or failed)" in r.stdout


def test_train_sweep_reads_metrics_json(cli, tmp_path):
    r = cli("-m", "mode=train", "model=dlrm_tiny", "train.steps=30", "train.eval_batches=2", "train.log_every=10",
            "train.batch_size=64,128", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = _sweep_dir(tmp_path)
    rows = _rows(sweep)
    assert [row["train.batch_size"] for row in rows] == ["64", "128"]
    for row in rows:
        assert row["fits"] == "yes", row
        assert float(row["measured_step_ms"]) > 0 and float(row["measured_samples_per_s"]) > 0
        assert float(row["final_loss"]) > 0 and 0 <= float(row["eval_auc"]) <= 1
        assert float(row["step_ms"]) > 0  # the plan's prediction sits beside the measurement
    for job in ("0", "1"):
        assert (sweep / job / "metrics.json").exists() and (sweep / job / "plan.json").exists()


def test_sweep_x_must_be_a_key_on_the_command_line(cli, tmp_path):
    r = cli("-m", "mode=describe", "hardware.nodes=1,2", "sweep.x=hardware.devices_per_node")
    assert r.returncode == 2
    assert r.stderr.strip() == ("neocfg: error: sweep.x='hardware.devices_per_node' is invalid: must be one of the keys"
                                " given on the command line: mode, hardware.nodes")
    assert not (tmp_path / "multirun").exists()


def _fake_sweep(root: Path, ok: list[bool]) -> Path:
    """A sweep directory whose runs ended ok or not (status.json), as the CLI writes them."""
    import json

    for job, good in enumerate(ok):
        run = root / str(job)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(f"- train.batch_size={64 * (job + 1)}\n")
        (run / "status.json").write_text(json.dumps({"ok": good, "error": None if good else "bad run"}))
    return root


def test_each_sweep_summary_reports_its_own_sweep(tmp_path):
    """The verdict of a sweep belongs to that sweep's callback: no state shared between instances (a failed
    sweep raises, a later good one in the same process does not)."""
    import pytest
    from omegaconf import OmegaConf

    from neocfg.errors import SweepFailedError
    from neocfg.sweep.callback import AllRunsFailed, SweepSummary

    def end(sweep_dir: Path) -> None:
        SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))

    with pytest.raises(AllRunsFailed) as failed:
        end(_fake_sweep(tmp_path / "bad", [False, False]))
    assert isinstance(failed.value.error, SweepFailedError) and failed.value.error.exit_code == 8
    assert "all 2 runs of the sweep failed (job 0: bad run)" in str(failed.value.error)
    end(_fake_sweep(tmp_path / "mixed", [True, False]))   # one run worked: rows, no error
    assert not [k for k, v in vars(SweepSummary).items() if not k.startswith("__") and not callable(v)]
