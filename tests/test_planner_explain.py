"""mode=plan explains itself: plan.md lists each table's sharding, tier, dtype and ranks as plan.json has them, with a
reason that holds when checked against the cost model and against plans made without the table's settings; the
critical device's terms add up to its total in plan.json; what binds agrees with that device's parts."""

from __future__ import annotations

import json

import pytest

from neocfg.planner import make_plan
from neocfg.planner.costs import CostModel
from neocfg.planner.estimate import placements_of, rate_plan
from neocfg.planner.explain import Binding, Reason, _Plan, explain, markdown
from neocfg.types import MemoryTier, ShardingType, WeightsDtype

from planner_helpers import ROUND_HW, round_cfg, tables_override

# big: too large for one device at table-wise; forced: a small table its own settings pin to row-wise, s0 one they
# keep to row- or column-wise; hot: a pooling so large that one device holding it all would be the busiest.
ROWS = ([("big", 20_000_000, 128, 2.0), ("forced", 1000, 64, 1.0), ("hot", 100_000, 64, 400.0)]
        + [(f"s{i}", 50_000, 64, 3.0) for i in range(6)])
# Unpipelined: the ids' payload is in the step (pipelined, it travels behind the compute and costs the step nothing),
# so one device receiving the whole table's ids is what makes table-wise the cheapest option for "big".
EXTRA = ["planner.memory_tiers=[hbm]", "hardware.device.hbm_gib=8", "+model.tables.1.sharding_types=[row_wise]",
         "+model.tables.3.sharding_types=[row_wise,column_wise]", "train.pipeline=false"]
MODEL = ["model.interaction=dcn", "model.bottom_mlp=[8]", "model.top_mlp=[4,1]", "model.num_dense_features=4"]
# 24 tables of 2.9 GiB on 8 devices of 8 GiB: a third of them cannot stay in device memory.
CROWDED = [(f"m{i}", 6_000_000, 128, 20.0) for i in range(24)]
CROWDED_EXTRA = ["planner.memory_tiers=[hbm,host]", "hardware.device.hbm_gib=8", "planner.sharding_types=[table_wise]"]


def _section(md: str, title: str) -> list[list[str]]:
    """The rows of the markdown table under '## title' (header and rule skipped)."""
    body = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def _ranks(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(r) for r in text.split(",")]


def test_plan_md_agrees_with_plan_json_and_its_reasons_hold(cli, tmp_path):
    r = cli("mode=plan", *ROUND_HW, tables_override(ROWS), *MODEL, *EXTRA)
    assert r.returncode == 0, r.stderr
    run_dir = next((tmp_path / "outputs").rglob("plan.json")).parent
    md = (run_dir / "plan.md").read_text()
    d = json.loads((run_dir / "plan.json").read_text())
    for text in ("critical device", "embedding compute", "embedding comm", "binds: network", "costliest tables",
                 "why each table:", "plan.md"):
        assert text in r.stdout, text

    # every table, as plan.json has it
    rows = {row[0]: row for row in _section(md, "Every table")}
    assert set(rows) == {t["name"] for t in d["tables"]}
    for t in d["tables"]:
        name, sharding, tier, dtype, ranks, reason, why = rows[t["name"]]
        assert (sharding, tier, dtype) == (t["sharding"], t["memory"], t["weights_dtype"])
        assert _ranks(ranks) == sorted({s["rank"] for s in t["shards"]})
        assert reason in {x.value for x in Reason} and why

    # the critical device's terms add up to its total in plan.json, and it is the busiest
    terms = dict((k, float(v)) for k, v in _section(md, "The critical device"))
    total_key = next(k for k in terms if k.startswith("total (device"))
    rank = int(total_key.split()[-1].rstrip(")"))
    busiest = max(d["devices"], key=lambda x: x["total_ms"])
    assert rank == busiest["rank"]
    assert terms[total_key] == pytest.approx(busiest["total_ms"], abs=1e-4)
    parts = terms["embedding compute"] + terms["embedding comm"] + terms["dense"] + terms["data"]
    assert parts == pytest.approx(busiest["total_ms"], abs=4e-4)
    assert terms["dense"] == pytest.approx(d["estimate"]["dense_ms"], abs=1e-4)
    data = busiest["total_ms"] - busiest["compute_ms"] - busiest["comm_ms"]
    assert terms["data"] == pytest.approx(data, abs=1e-4)
    assert terms["embedding comm"] == pytest.approx(busiest["comm_ms"] - d["estimate"]["dense_comm_ms"], abs=1e-4)
    # binds network: that device's communication outweighs its compute and data
    assert busiest["comm_ms"] > busiest["compute_ms"] + data
    # the costliest tables listed all have a piece on the critical device
    by_name = {t["name"]: t for t in d["tables"]}
    costly = _section(md, "The tables that cost most")
    assert costly and all(any(s["rank"] == rank for s in by_name[row[0]]["shards"]) for row in costly
                          if float(row[1]) > 0)

    # the reasons, against facts
    cfg = round_cfg(ROWS, *EXTRA)
    cost = CostModel.from_config(cfg)
    assert rows["big"][5] == "memory"
    big_tw = cost.piece(cfg.model.tables[0], ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)[1]
    assert not big_tw.fits(cost.capacity)    # too big for one device
    assert rows["forced"][5] == "constraint" and rows["forced"][1] == "row_wise"
    assert rows["s0"][5] == "constraint" and "rule out" in rows["s0"][6]
    free = make_plan(round_cfg(ROWS, *EXTRA[:2]))    # the same model without the tables' own settings
    assert free.table("forced").sharding is not ShardingType.row_wise
    assert free.table("s0").sharding not in (ShardingType.row_wise, ShardingType.column_wise)
    assert rows["hot"][5] == "balance" and rows["hot"][1] != "table_wise"
    pinned = make_plan(round_cfg(ROWS, *EXTRA, "+model.tables.2.sharding_types=[table_wise]"))
    assert pinned.estimate.step_ms > d["estimate"]["step_ms"] * 1.2   # one device holding it all is slower


def test_memory_binds_when_the_busiest_device_holds_a_table_pushed_out_of_device_memory():
    cfg = round_cfg(CROWDED, *CROWDED_EXTRA)
    plan = make_plan(cfg)
    ex = explain(cfg, plan)
    cost = CostModel.from_config(cfg)
    in_host = {t.name for t in plan.tables if t.memory is MemoryTier.host}
    assert in_host and {c.name for c in ex.tables if c.reason is Reason.memory} == in_host
    for name in in_host:   # each fits a device alone: it is the plan's room that keeps it out
        table = next(t for t in cfg.model.tables if t.name == name)
        assert cost.piece(table, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)[1].fits(cost.capacity)
    hbm_need = sum(cost.piece(t, ShardingType.table_wise, MemoryTier.hbm, WeightsDtype.fp32, 1)[1].hbm
                   for t in cfg.model.tables)
    assert hbm_need > cost.capacity.hbm * cfg.hardware.num_devices
    critical = ex.terms.rank
    assert any(s.rank == critical for t in plan.tables if t.name in in_host for s in t.shards)
    assert ex.binds is Binding.memory and "does not fit" in ex.binds_detail
    # with the room it needs, nothing is pushed out and memory no longer binds
    roomy = round_cfg(CROWDED, *CROWDED_EXTRA[:1], "hardware.device.hbm_gib=32", CROWDED_EXTRA[2])
    ex_roomy = explain(roomy, make_plan(roomy))
    assert ex_roomy.binds is not Binding.memory
    assert all(c.reason is not Reason.memory for c in ex_roomy.tables)


@pytest.mark.parametrize("overrides", [
    [*ROUND_HW, tables_override(ROWS), *MODEL, *EXTRA],
    [*ROUND_HW, tables_override(CROWDED), *MODEL, *CROWDED_EXTRA],
    ["hardware=zionex_2node", "planner.weights_dtypes=[fp32,fp16]"],   # with latencies and kernel overheads
], ids=["mixed", "crowded", "dlrm_tiny_zionex"])
def test_device_times_add_up_as_the_planner_priced_them(overrides):
    from conftest import compose_cfg

    # (explain reasons in the solver's terms, the outputs' all-to-all exposed: the plan waits for it at once here)
    cfg = compose_cfg(overrides + ["train.output_overlap=wait"])
    plan = make_plan(cfg)
    cost = CostModel.from_config(cfg)
    compute, comm = _Plan(cost, placements_of(cfg, cost, plan)).device_ms()
    e = plan.estimate
    for dev in plan.devices:
        assert compute[dev.rank] == pytest.approx(dev.compute_ms - e.dense_compute_ms, rel=1e-9, abs=1e-9)
        assert comm[dev.rank] == pytest.approx(dev.comm_ms - e.dense_comm_ms, rel=1e-9, abs=1e-9)


def test_a_given_plan_says_so():
    cfg = round_cfg(ROWS, *EXTRA)
    plan = make_plan(cfg)
    given = rate_plan(cfg, plan, "test")
    ex = explain(cfg, given)
    assert ex.given and "was given" in markdown(cfg, given, ex)
    assert not explain(cfg, plan).given
    assert [c.reason for c in ex.tables] == [c.reason for c in explain(cfg, plan).tables]
