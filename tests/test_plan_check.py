"""A plan file whose shards do not cover each table exactly once, sit on ranks outside the
world, disagree with the model or carry wrongly typed fields is refused with one line naming the file, the table and
the fault (unit cases per fault, then through the real CLI: non-zero exit, no traceback, nothing trained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose_cfg
from neocfg.plan_check import PlanError, load_plan_file
from neocfg.runtime.plans import rule_plan
from neocfg.types import ShardingType as S

COMMON = ["mode=train", "train.batch_size=64", "train.steps=4", "train.eval_batches=1"]
# dlrm_tiny (8 tables of 16 columns) on 2 ranks: t0 TW, t1 RW, t2 DP, t3 CW (2 slices of 8), t4 RW, t5 TW,
# t6 TWRW, t7 DP.
MIXED = [S.table_wise, S.row_wise, S.data_parallel, S.column_wise, S.row_wise, S.table_wise, S.table_row_wise,
         S.data_parallel]


@pytest.fixture(scope="module")
def cfg():
    return compose_cfg(COMMON)


def _plan_dict(cfg) -> dict:
    sharding = {t.name: s for t, s in zip(cfg.model.tables, MIXED)}
    return rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=sharding,
                     step_ms=10.0).to_dict()


def _table(d: dict, name: str) -> dict:
    return next(t for t in d["tables"] if t["name"] == name)


def _write(tmp_path: Path, d: dict) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    return path


def _overlap(d):
    _table(d, "t1")["shards"][1]["row_offset"] -= 10  # rows 2490..2499 owned twice, last 10 rows by no one


def _gap(d):
    _table(d, "t4")["shards"][1]["num_rows"] -= 7


def _half_columns(d):
    t = _table(d, "t3")
    t["shards"] = t["shards"][:1]  # one slice of 8 columns of 16


def _rank_outside(d):
    _table(d, "t0")["shards"][0]["rank"] = 2


def _string_rows(d):
    _table(d, "t5")["shards"][0]["num_rows"] = "2000"


def _dims(d):
    t = _table(d, "t7")
    t["embedding_dim"] = 32
    for s in t["shards"]:
        s["num_cols"] = 32


def _dp_missing_replica(d):
    _table(d, "t2")["shards"].pop()


def _dp_fp16(d):
    _table(d, "t2")["weights_dtype"] = "fp16"   # runtime/replicated.py stores replicas in fp32 whatever the plan says


def _table_missing(d):
    d["tables"] = [t for t in d["tables"] if t["name"] != "t6"]


def _bad_enum(d):
    _table(d, "t0")["sharding"] = "diagonal"


CASES = {
    "overlap": (_overlap, "table t1", "more than one shard"),
    "gap": (_gap, "table t4", "in no shard"),
    "half_columns": (_half_columns, "table t3", "columns 8..15 are in no shard"),
    "rank_outside": (_rank_outside, "table t0", "rank 2, outside the world"),
    "string_rows": (_string_rows, "table t5 shard 0", "num_rows='2000' must be an integer"),
    "dims": (_dims, "table t7", "100x32 in the plan but 100x16 in model"),
    "dp_missing_replica": (_dp_missing_replica, "table t2", "one replica on each of ranks 0..1"),
    "dp_fp16": (_dp_fp16, "table t2", "weights_dtype=fp16 is not allowed for data_parallel"),
    "table_missing": (_table_missing, "table t6", "not in the plan"),
    "bad_enum": (_bad_enum, "table t0", "sharding='diagonal' is not one of"),
}


def test_valid_plan_passes(cfg, tmp_path):
    plan = load_plan_file(_write(tmp_path, _plan_dict(cfg)), cfg.model, 2)
    assert [t.name for t in plan.tables] == [t.name for t in cfg.model.tables]


@pytest.mark.parametrize("case", sorted(CASES))
def test_fault_is_named(cfg, tmp_path, case):
    break_it, where, fault = CASES[case]
    d = _plan_dict(cfg)
    break_it(d)
    path = _write(tmp_path, d)
    with pytest.raises(PlanError) as exc:
        load_plan_file(path, cfg.model, 2)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: {where}") and fault in msg, msg
    assert "\n" not in msg


def test_world_mismatch(cfg, tmp_path):
    with pytest.raises(PlanError, match="world size 2, the hardware has 4"):
        load_plan_file(_write(tmp_path, _plan_dict(cfg)), cfg.model, 4)


@pytest.mark.parametrize("case", ["overlap", "string_rows", "dp_fp16"])
def test_cli_refuses_bad_plan(cli, cfg, tmp_path, case):
    d = _plan_dict(cfg)
    CASES[case][0](d)
    path = _write(tmp_path, d)
    r = cli(*COMMON, f"planner.plan_file={path}")
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and str(path) in err[0] and CASES[case][1] in err[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not list((tmp_path / "outputs").rglob("metrics.json")) and not list((tmp_path / "outputs").rglob("*.pt"))


# ---- mode=plan planner.plan_file=...: rate a given plan without solving ----------------------
def _solved(overrides: list[str]):
    from neocfg.planner import make_plan

    cfg = compose_cfg(["mode=plan", *overrides])
    return cfg, make_plan(cfg)


@pytest.mark.parametrize("overrides", [[], ["hardware=zionex_2node"]], ids=["cpu_local", "zionex_2node"])
def test_rating_a_solved_plan_reproduces_its_estimate(overrides):
    from neocfg.planner.estimate import rate_plan

    cfg, plan = _solved(overrides)
    rated = rate_plan(cfg, plan, "solved")
    assert rated.solver.algorithm == "given" and plan.solver.algorithm != "given"
    assert rated.estimate.step_ms == pytest.approx(plan.estimate.step_ms, rel=1e-9)
    for a, b in zip(rated.devices, plan.devices):
        assert (a.rank, a.hbm_bytes, a.host_bytes, a.shard_counts) == (b.rank, b.hbm_bytes, b.host_bytes,
                                                                        b.shard_counts)
        assert a.total_ms == pytest.approx(b.total_ms, rel=1e-9)
    assert rated.tables == plan.tables


def test_rating_a_worse_plan(cfg):
    """Everything on rank 0 (table-wise) is rated slower than the solver's plan, rank 0 the busiest."""
    from neocfg.planner.estimate import rate_plan

    pcfg, solved = _solved([])
    lopsided = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=256, sharding=S.table_wise,
                         ranks={t.name: [0] for t in cfg.model.tables})
    rated = rate_plan(pcfg, lopsided, "lopsided")
    assert rated.estimate.step_ms > solved.estimate.step_ms
    assert rated.devices[0].total_ms > rated.devices[1].total_ms
    assert rated.devices[0].shard_counts == {"table_wise": 8} and rated.devices[1].shard_counts == {}


def test_cli_plan_rates_the_file(cli, cfg, tmp_path):
    path = _write(tmp_path, _plan_dict(cfg))
    r = cli("mode=plan", f"planner.plan_file={path}")
    assert r.returncode == 0, r.stderr
    assert "solver given:" in r.stdout and "estimate: step" in r.stdout
    out = json.loads(next((tmp_path / "outputs").rglob("plan.json")).read_text())
    assert out["solver"]["algorithm"] == "given" and out["estimate"]["step_ms"] > 0
    given = {t["name"]: t["shards"] for t in _plan_dict(cfg)["tables"]}
    assert {t["name"]: t["shards"] for t in out["tables"]} == given
    assert [t["sharding"] for t in out["tables"]] == [s.value for s in MIXED]


@pytest.mark.parametrize("case", ["overlap", "dp_fp16"])
def test_cli_plan_refuses_bad_file(cli, cfg, tmp_path, case):
    """mode=plan (the estimate) refuses it too: e.g. a DP table in fp16 would be sized at half the replica's bytes."""
    break_it, where, fault = CASES[case]
    d = _plan_dict(cfg)
    break_it(d)
    path = _write(tmp_path, d)
    r = cli("mode=plan", f"planner.plan_file={path}")
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(err) == 1 and where in err[0] and fault in err[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "outputs").rglob("plan.json"))


def _no_all_to_all_plan(cfg, **strategies) -> dict:
    """dlrm_tiny on 2 ranks with every table row-wise or data-parallel (no pooled output by all-to-all), its
    strategies resolved for DDP and then set to `strategies`."""
    from neocfg.planner.strategies import with_strategies

    sharding = {t.name: (S.row_wise, S.data_parallel)[i % 2] for i, t in enumerate(cfg.model.tables)}
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=sharding, step_ms=10.0)
    d = with_strategies(compose_cfg([*COMMON, "train.dense_grad_sync=ddp"]), plan).to_dict()
    assert d["strategies"]["output_overlap"] is False and d["strategies"]["dense_grad_sync"] == "ddp"
    d["strategies"].update(strategies)
    return d


@pytest.mark.parametrize("strategies,key", [({"output_overlap": True}, "output_overlap=true"),
                                            ({"dense_grad_sync": "exchange"}, "dense_grad_sync=exchange")])
def test_a_strategy_without_an_all_to_all_output_is_refused(cfg, tmp_path, strategies, key):
    # The outputs' all-to-all overlapped with the bottom MLP, or carrying the dense gradients, where no table's
    # outputs come back by all-to-all: the plan validator refuses it (the one the Trainer relies on too).
    path = _write(tmp_path, _no_all_to_all_plan(cfg, **strategies))
    with pytest.raises(PlanError) as exc:
        load_plan_file(path, cfg.model, 2)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: strategies: {key}") and "no table's pooled outputs come back by all-to-all" in msg
    assert "\n" not in msg
    assert load_plan_file(_write(tmp_path, _no_all_to_all_plan(cfg)), cfg.model, 2).strategies.output_overlap is False


@pytest.mark.parametrize("mode", ["plan", "train"])
def test_cli_refuses_output_overlap_without_an_all_to_all_output(cli, cfg, tmp_path, mode):
    # A given plan file mode=plan accepts is one mode=train runs: both refuse this one, in one line, before any work.
    path = _write(tmp_path, _no_all_to_all_plan(cfg, output_overlap=True))
    r = cli(*(["mode=plan"] if mode == "plan" else COMMON), f"planner.plan_file={path}")
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(err) == 1, r.stderr
    assert str(path) in err[0] and "strategies: output_overlap=true" in err[0] and "allowed: output_overlap=false" \
        in err[0], err[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert not list((tmp_path / "outputs").rglob("plan.json"))
