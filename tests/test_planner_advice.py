"""Advice that is right: every count in "verified to fit" is planned by the configured planner (the ILP by default),
bisected on node count and batch: never more nodes (nor a smaller batch) than that planner needs, never a count it
does not fit."""

from __future__ import annotations

import dataclasses
import re

import pytest

from neocfg.config.schema import MAX_NODES
from neocfg.errors import NeocfgError
from neocfg.planner import advice, make_plan
from neocfg.planner.advice import Prober, largest_batch, smallest_nodes, with_nodes
from neocfg.types import PlannerAlgorithm

from conftest import compose_cfg


def _plans(cfg) -> bool:
    try:
        make_plan(cfg)
    except NeocfgError:
        return False
    return True


class FakePlanners:
    """Greedy fits from `greedy_from` on, the ILP from `ilp_from` on (by node count; by batch: up to the values);
    records every probe as (algorithm, value)."""

    def __init__(self, key: str, greedy_from: int, ilp_from: int):
        self.key, self.greedy_from, self.ilp_from = key, greedy_from, ilp_from
        self.probes: list[tuple[str, int]] = []

    def __call__(self, cfg) -> bool:
        value = cfg.hardware.nodes if self.key == "nodes" else cfg.train.batch_size
        alg = cfg.planner.algorithm.value
        self.probes.append((alg, value))
        limit = self.greedy_from if alg == "greedy" else self.ilp_from
        return value >= limit if self.key == "nodes" else value <= limit


@pytest.mark.parametrize("greedy_from,ilp_from", [(5, 2), (6, 3), (37, 20), (3, 3), (4, 9)])
def test_smallest_nodes_is_the_configured_planners_own(monkeypatch, greedy_from, ilp_from):
    # The ILP packs memory-tight models on fewer nodes than greedy (5 vs 2 for prod_856 on zionex_1node); and where
    # the ILP's plan fails where greedy's fits (its faster plan over the trainer ingest limit), the search goes up.
    fake = FakePlanners("nodes", greedy_from, ilp_from)
    monkeypatch.setattr(advice, "fits", fake)
    cfg = compose_cfg(["hardware=zionex_1node"])
    assert smallest_nodes(cfg, Prober(float("inf"))) == ilp_from
    ilp = [n for alg, n in fake.probes if alg == "ilp"]
    assert ilp_from in ilp and ilp_from - 1 in ilp + [cfg.hardware.nodes]   # both sides of the answer planned
    if ilp_from <= greedy_from:
        assert max(ilp) <= greedy_from                                      # bisected below greedy's count


def test_smallest_nodes_with_the_greedy_planner_probes_greedy_only(monkeypatch):
    fake = FakePlanners("nodes", 5, 2)
    monkeypatch.setattr(advice, "fits", fake)
    cfg = compose_cfg(["hardware=zionex_1node", "planner.algorithm=greedy"])
    assert smallest_nodes(cfg, Prober(float("inf"))) == 5
    assert {alg for alg, _ in fake.probes} == {"greedy"}


def test_no_node_count_fits_gives_none(monkeypatch):
    monkeypatch.setattr(advice, "fits", FakePlanners("nodes", MAX_NODES + 1, MAX_NODES + 1))
    assert smallest_nodes(compose_cfg(["hardware=zionex_1node"]), Prober(float("inf"))) is None


@pytest.mark.parametrize("greedy_to,ilp_to", [(100, 700), (1000, 1000), (1, 3), (500, 300)])
def test_largest_batch_is_the_configured_planners_own(monkeypatch, greedy_to, ilp_to):
    fake = FakePlanners("batch", greedy_to, ilp_to)
    monkeypatch.setattr(advice, "fits", fake)
    cfg = compose_cfg(["hardware=zionex_1node", "train.batch_size=4096"])
    assert largest_batch(cfg, Prober(float("inf"))) == ilp_to
    ilp = [b for alg, b in fake.probes if alg == "ilp"]
    assert ilp_to in ilp and ilp_to + 1 in ilp + [cfg.train.batch_size]


def _advised_nodes(text: str) -> int:
    found = re.search(r"verified to fit: .*?(?<!with )hardware\.nodes>=(\d+)", text)
    assert found, text
    return int(found.group(1))


def test_prod_856_advice_asks_for_the_nodes_the_ilp_plans(cli):
    # As a user meets it: prod_856 does not fit one ZionEX node; the advice names the node count the ILP plans it on
    # (greedy needs 5), and the ILP does not plan it on one node fewer.
    r = cli("mode=plan", "model=prod_856", "hardware=zionex_1node")
    assert r.returncode != 0
    assert "advice: hardware.nodes=" in r.stderr   # each probe of the planner is reported as it ends
    nodes = _advised_nodes(r.stderr)
    cfg = compose_cfg(["model=prod_856", "hardware=zionex_1node"])
    assert cfg.planner.algorithm is PlannerAlgorithm.ilp
    assert _plans(with_nodes(cfg, nodes))
    assert not _plans(with_nodes(cfg, nodes - 1))
    greedy = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, algorithm=PlannerAlgorithm.greedy))
    assert not _plans(with_nodes(greedy, nodes))   # the case greedy probes got wrong


# A model of six large tables (64 columns, 0.1-0.9 GiB each in fp32) on nodes of 2 devices with 1 GiB of HBM and
# 0.75 GiB of host DDR each: memory decides the node count, and the pieces are large enough to pack badly.
OWN_TABLES = [("big", 3_750_000), ("b2", 3_250_000), ("b3", 2_625_000), ("m1", 1_875_000), ("m2", 1_375_000),
              ("s1", 500_000)]
OWN = ["hardware=zionex_1node", "hardware.devices_per_node=2", "hardware.device.hbm_gib=1", "hardware.host.ddr_gib=1.5",
       "planner.time_limit_s=10", "model.bottom_mlp=[128,64]",
       "model.tables=[" + ",".join(f"{{name:{n},num_embeddings:{r},embedding_dim:64,pooling_factor:8}}"
                                   for n, r in OWN_TABLES) + "]"]


def test_own_model_advice_is_the_smallest_count_the_ilp_plans(cli):
    r = cli("mode=plan", *OWN)
    assert r.returncode != 0 and "does not fit" in r.stderr, r.stderr
    nodes = _advised_nodes(r.stderr)
    cfg = compose_cfg(OWN)
    assert nodes > cfg.hardware.nodes
    assert _plans(with_nodes(cfg, nodes))
    assert not _plans(with_nodes(cfg, nodes - 1))
    r = cli("mode=plan", *OWN, f"hardware.nodes={nodes}")   # the advice works as written
    assert r.returncode == 0, r.stderr
