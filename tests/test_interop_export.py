"""Without TorchRec: `neocfg mode=plan planner.export=torchrec` writes torchrec_plan.json beside
plan.json, the same placement in TorchRec's terms (sharding type, compute kernel of the memory tier, ranks, shard
offsets and sizes), and plans TorchRec could not run as given are refused with one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import compose_cfg
from neocfg.errors import DataError
from neocfg.interop.export import EXPORT_FORMAT, read_torchrec_dict, table_plan_of, to_torchrec_dict
from neocfg.plan import Shard
from neocfg.runtime.plans import rule_plan
from neocfg.types import MemoryTier, ShardingType as S


def test_cli_exports_the_plan(cli, tmp_path):
    r = cli("mode=plan", "hardware=zionex_2node", "planner.export=torchrec")
    assert r.returncode == 0, r.stderr
    assert "TorchRec plan written to" in r.stdout
    run = next((tmp_path / "outputs").rglob("plan.json")).parent
    plan, tr = json.loads((run / "plan.json").read_text()), json.loads((run / "torchrec_plan.json").read_text())
    assert tr["format"] == EXPORT_FORMAT and tr["compute_device"] == "cuda"
    assert (tr["world_size"], tr["local_world_size"]) == (16, 8)
    assert list(tr["tables"]) == [t["name"] for t in plan["tables"]]
    for t in plan["tables"]:
        e = tr["tables"][t["name"]]
        assert e["sharding_type"] == t["sharding"]
        assert e["compute_kernel"] == ("dense" if t["sharding"] == "data_parallel" else
                                       {"hbm": "fused", "uvm_caching": "fused_uvm_caching", "host": "fused_uvm"}[
                                           t["memory"]])
        if t["sharding"] == "data_parallel":
            assert e["shards"] is None and sorted(e["ranks"]) == list(range(16))
            continue
        mine = sorted((s["rank"], s["row_offset"], s["col_offset"], s["num_rows"], s["num_cols"]) for s in t["shards"])
        theirs = sorted((s["rank"], *s["offsets"], *s["sizes"]) for s in e["shards"])
        assert mine == theirs
        assert e["ranks"] == [s["rank"] for s in e["shards"]]
        offsets = [s["offsets"] for s in e["shards"]]
        assert offsets == sorted(offsets, key=lambda o: (o[1], o[0]))  # slices left to right, row ranges in order


def test_tiers_and_round_trip():
    cfg = compose_cfg([])
    sharding = {t.name: s for t, s in zip(cfg.model.tables, [S.table_wise, S.column_wise, S.data_parallel,
                                                              S.table_column_wise] * 2)}
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=sharding,
                     memory=MemoryTier.uvm_caching)
    d = to_torchrec_dict(plan, "cuda")
    kernels = {e["compute_kernel"] for e in d["tables"].values()}
    assert kernels == {"fused_uvm_caching", "dense"}
    for t in plan.tables:
        back = table_plan_of(t.name, t.num_embeddings, t.embedding_dim, d["tables"][t.name], 2)
        assert back.sharding == t.sharding and set(back.shards) == set(t.shards)
        assert back.memory == (MemoryTier.hbm if t.sharding is S.data_parallel else MemoryTier.uvm_caching)


def test_row_split_torchrec_cannot_route_is_refused():
    """TorchRec routes a row-wise id to shard id // ceil(rows / shards): 1,000 rows as 501 + 499 cannot be routed
    (the ceil split, 500 + 500, can), so the export refuses it naming the table."""
    cfg = compose_cfg([])
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=S.row_wise)
    to_torchrec_dict(plan, "cpu")  # dlrm_tiny's even row splits are ceil splits
    t0 = plan.tables[0]
    skewed = dataclasses.replace(t0, shards=(Shard(0, 0, 501, 0, 16), Shard(1, 501, 499, 0, 16)))
    bad = dataclasses.replace(plan, tables=(skewed, *plan.tables[1:]))
    with pytest.raises(DataError, match=r"table t0: TorchRec's row_wise needs rows split in blocks of ceil\(1000/2\)"):
        to_torchrec_dict(bad, "cpu")


def test_reading_a_wrong_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tables": []}))
    with pytest.raises(DataError, match="not a neocfg-torchrec-plan file"):
        read_torchrec_dict(path)
