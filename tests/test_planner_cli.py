"""Through the real CLI: mode=plan writes plan.json (contract keys), plan.png and prints the summary;
infeasible and bad input exit non-zero with one line and leave nothing behind."""

from __future__ import annotations

import json

import pytest

from neocfg.plan import Plan

PLAN_KEYS = {"world_size", "nodes", "devices_per_node", "batch_size_per_device", "tables", "devices", "estimate",
             "solver", "dpp"}
TABLE_KEYS = {"name", "sharding", "memory", "weights_dtype", "shards"}
SHARD_KEYS = {"rank", "row_offset", "num_rows", "col_offset", "num_cols"}
DEVICE_KEYS = {"rank", "hbm_bytes", "host_bytes", "compute_ms", "comm_ms", "total_ms"}
SOLVER_KEYS = {"algorithm", "status", "seconds", "objective_ms", "lower_bound_ms", "gap", "placement_source"}
DPP_KEYS = {"workers", "workers_per_trainer_node", "bottleneck", "demand_samples_per_s", "capacity_samples_per_s"}


def _one_run_dir(tmp_path):
    found = list((tmp_path / "outputs").rglob("plan.json"))
    assert len(found) == 1
    return found[0].parent


def test_plan_dcnv2_on_zionex_16node(cli, tmp_path):
    r = cli("mode=plan", "model=dcnv2_mlperf", "hardware=zionex_16node", "dsi=prod_like")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("plan dcnv2_mlperf on zionex_16node: 128 devices", "HBM GiB", "compute ms", "comm ms",
                 "estimate: step", "samples/s", "lower bound", "gap", "DPP:", "bottleneck", "totals:"):
        assert text in out, text
    run_dir = _one_run_dir(tmp_path)
    assert (run_dir / "plan.png").stat().st_size > 10_000
    d = json.loads((run_dir / "plan.json").read_text())
    assert PLAN_KEYS <= d.keys()
    assert d["world_size"] == 128 and d["nodes"] == 16 and d["devices_per_node"] == 8
    assert len(d["tables"]) == 26 and len(d["devices"]) == 128
    for t in d["tables"]:
        assert TABLE_KEYS <= t.keys() and all(SHARD_KEYS <= s.keys() for s in t["shards"])
        assert t["sharding"] in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise",
                                 "data_parallel")
        assert t["memory"] in ("hbm", "uvm_caching", "host") and t["weights_dtype"] in ("fp32", "fp16")
    assert all(DEVICE_KEYS <= x.keys() for x in d["devices"])
    assert {"step_ms", "samples_per_s"} <= d["estimate"].keys()
    assert SOLVER_KEYS <= d["solver"].keys() and d["solver"]["gap"] <= 0.05
    assert DPP_KEYS <= d["dpp"].keys()
    assert max(x["hbm_bytes"] for x in d["devices"]) <= 40 * 1024**3
    plan = Plan.load(run_dir / "plan.json")
    assert plan.solver.objective_ms == pytest.approx(d["solver"]["objective_ms"])


def test_plan_default_cpu_local_greedy(cli, tmp_path):
    r = cli("mode=plan", "planner.algorithm=greedy")
    assert r.returncode == 0, r.stderr
    assert "plan dlrm_tiny on cpu_local: 2 devices" in r.stdout and "solver greedy" in r.stdout
    d = json.loads((_one_run_dir(tmp_path) / "plan.json").read_text())
    assert {t["memory"] for t in d["tables"]} == {"hbm"}


def _error_lines(stderr: str) -> list[str]:
    """The error lines of stderr; every other line must be the advice search's progress (long probes say so)."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    progress = [x for x in lines if x.startswith(("planning ", "advice: "))]
    assert len(progress) + len([x for x in lines if x.startswith("neocfg: error")]) == len(lines), stderr
    return [x for x in lines if not x.startswith(("planning ", "advice: "))]


def test_infeasible_exits_nonzero_with_one_line(cli, tmp_path):
    r = cli("mode=plan", "model=neo_model_f_12t", "hardware=zionex_1node")
    assert r.returncode == 3
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("neocfg: error: table f")
    assert "does not fit" in lines[0] and "GiB" in lines[0] and ("fp16" in lines[0] or "nodes" in lines[0])
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.rglob("plan.json")) and not (tmp_path / "outputs").exists()


def test_ingest_limit_through_cli(cli, tmp_path):
    r = cli("mode=plan", "model=dlrm_tiny", "hardware=zionex_1node", "dsi.trainer_ingest_gbs=0.5")
    assert r.returncode == 3
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and "dsi.trainer_ingest_gbs" in lines[0]
    assert not list(tmp_path.rglob("plan.json"))


@pytest.mark.parametrize("override,needles", [
    ("planner.algorithm=magic", ["planner.algorithm", "magic", "greedy"]),
    ("planner.costs.hbm_efficiency=1.5", ["planner.costs.hbm_efficiency", "1.5", "(0.0, 1.0]"]),
    ("planner.costs.nope=1", ["planner.costs.nope"]),
])
def test_bad_planner_input_is_one_line(cli, tmp_path, override, needles):
    r = cli("mode=plan", override)
    assert r.returncode == 2, r.stdout
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and all(n in line for n in needles), line
    assert not list(tmp_path.rglob("plan.json"))


def test_model_of_mixed_dims_without_interaction_plans_with_dcn(cli, tmp_path):
    # Only name and tables, of different dims: interaction=auto picks dcn and says so.
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    rows = "\n".join(f"  - {{name: t{i}, num_embeddings: {5000 + i}, embedding_dim: {16 * (1 + i % 3)},"
                     f" pooling_factor: 2}}" for i in range(6))
    (conf / "model" / "mixed.yaml").write_text(f"name: mixed\ntables:\n{rows}\n")
    r = cli("mode=plan", "model=mixed", f"hydra.searchpath=[file://{conf}]", "hardware=zionex_1node")
    assert r.returncode == 0, r.stderr
    assert "model.interaction=auto -> dcn (embedding dims differ: [16, 32, 48])" in r.stderr
    assert "placement from" in r.stdout
    same = cli("mode=plan", "model=dlrm_tiny", "model.interaction=auto")
    assert same.returncode == 0 and "model.interaction=auto -> dot" in same.stderr
