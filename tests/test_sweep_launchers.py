"""Sweeps on Hydra's parallel launchers (the `test` extra installs the joblib and Ray plugins): the summary and the
"every run failed" exit code under each, training runs under joblib's loky workers, and the line that names the
package of a launcher that is not installed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
# A Ray cluster of its own (address=local: never another run's), two CPUs like the machine CI runs on.
RAY = ["hydra/launcher=ray", "+hydra.launcher.ray.init.address=local", "+hydra.launcher.ray.init.num_cpus=2",
       "+hydra.launcher.ray.init.include_dashboard=false"]
PLAN = ["mode=plan", "model=dlrm_tiny", "hardware=zionex_1node", "planner.algorithm=greedy"]


def _summary(tmp_path: Path) -> tuple[Path, list[dict[str, str]]]:
    dirs = [p.parent for p in (tmp_path / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    with open(dirs[0] / "sweep_summary.csv") as f:
        return dirs[0], list(csv.DictReader(f))


@pytest.mark.parametrize("launcher", [JOBLIB, RAY], ids=["joblib", "ray"])
def test_plan_sweep_on_a_parallel_launcher_writes_its_summary(cli, tmp_path, launcher):
    r = cli("-m", *launcher, *PLAN, "hardware.nodes=1,2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sweep, rows = _summary(tmp_path)
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"):
        assert (sweep / name).stat().st_size > 0, name
    assert sorted(row["hardware.nodes"] for row in rows) == ["1", "2"]
    assert all(row["fits"] == "yes" and float(row["step_ms"]) > 0 for row in rows), rows


@pytest.mark.parametrize("launcher", [JOBLIB, RAY], ids=["joblib", "ray"])
def test_sweep_in_which_every_run_fails_exits_8(cli, tmp_path, launcher):
    r = cli("-m", *launcher, *PLAN, "hardware.device.hbm_gib=0.0001,0.0002", timeout=600)
    assert r.returncode == 8, (r.returncode, r.stderr[-3000:])
    assert "all 2 runs of the sweep failed" in r.stderr
    _, rows = _summary(tmp_path)
    assert [row["fits"] for row in rows] == ["no", "no"] and all("does not fit" in row["why"] for row in rows)


def test_train_sweep_under_joblib_writes_its_summary(cli, tmp_path):
    """Ranks start from loky's workers (whose process-wide start method, 'loky', a spawned child cannot set up)."""
    r = cli("-m", *JOBLIB, "mode=train", "model=dlrm_tiny", "train.steps=12", "train.eval_batches=2",
            "train.log_every=4", "train.batch_size=64,128", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot find context" not in r.stderr and "Traceback" not in r.stderr
    _, rows = _summary(tmp_path)
    assert sorted(row["train.batch_size"] for row in rows) == ["128", "64"]
    assert all(row["fits"] == "yes" and float(row["measured_step_ms"]) > 0 for row in rows), rows


def test_a_launcher_that_is_not_installed_names_its_package(cli, tmp_path):
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
        pytest.skip("hydra-submitit-launcher is installed here (the `launchers` extra)")
    r = cli("-m", "hydra/launcher=submitit_slurm", "mode=describe", "model=dlrm_tiny,criteo_kaggle")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install hydra-submitit-launcher" in lines[0], r.stderr


def test_joblib_sweep_of_a_model_written_with_1e7(cli, tmp_path):
    """loky's workers compose each job's config themselves: integer keys written as 1e7 are taken there too."""
    model = tmp_path / "myconf" / "model" / "sci.yaml"
    model.parent.mkdir(parents=True)
    model.write_text("name: sci\nnum_dense_features: 4\nbottom_mlp: [16, 8]\ntop_mlp: [16, 1]\ninteraction: dot\n"
                     "tables:\n  - {name: a, num_embeddings: 1e7, embedding_dim: 8, pooling_factor: 1}\n"
                     "  - {name: b, num_embeddings: 2e3, embedding_dim: 8, pooling_factor: 2}\n")
    r = cli("-m", "--config-dir", str(tmp_path / "myconf"), *JOBLIB, *PLAN[:1], "model=sci",
            *PLAN[2:], "hardware.nodes=1,2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _, rows = _summary(tmp_path)
    assert all(row["fits"] == "yes" and float(row["step_ms"]) > 0 for row in rows), rows
    plans = sorted((tmp_path / "multirun").rglob("plan.json"))
    assert len(plans) == 2 and all('"num_embeddings": 10000000' in p.read_text() for p in plans)
