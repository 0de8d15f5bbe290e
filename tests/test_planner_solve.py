"""Greedy and ILP planners. Tiny instances come out exactly optimal (brute force); every plan respects
memory, keeps the shard geometry contract and reports a lower bound <= its objective."""

from __future__ import annotations

import dataclasses
import time

import pytest

from neocfg.errors import InfeasibleError
from neocfg.planner import make_plan
from neocfg.planner.costs import CostModel
from neocfg.planner.greedy import greedy_place
from neocfg.planner.ilp_flat import solve_flat
from neocfg.planner.ilp_problem import IlpProblem
from neocfg.planner.loads import DeviceLoads
from neocfg.planner.options import all_options
from neocfg.planner.pipeline import plan_placement
from neocfg.planner.types import PlacementSource
from neocfg.types import ShardingType

from conftest import compose_cfg
from planner_helpers import brute_force_makespan, check_plan_contract, round_cfg, tables_override, unpruned_options

# 1 node x 3 devices; HBM per device small enough that memory binds.
TINY_HW = ["hardware.nodes=1", "hardware.devices_per_node=3", "planner.costs.comm_tiebreak=0",
           "planner.mip_gap=0", "planner.exact_max_variables=100000"]
TINY_INSTANCES = [
    [("a", 40_000, 16, 8), ("b", 20_000, 16, 3), ("c", 5_000, 16, 1), ("d", 60_000, 16, 2), ("e", 300, 16, 5)],
    [("a", 10_000, 24, 1), ("b", 10_000, 24, 1), ("c", 10_000, 24, 1), ("d", 10_000, 24, 1),
     ("e", 2_000, 8, 20), ("f", 700, 8, 3)],
]


def tiny(rows, hbm_gib: float, shardings: str):
    return round_cfg(rows, *TINY_HW, f"hardware.device.hbm_gib={hbm_gib}", f"planner.sharding_types={shardings}",
                     "planner.memory_tiers=[hbm]")


@pytest.mark.parametrize("case", range(len(TINY_INSTANCES)))
def test_ilp_is_exactly_optimal_on_tiny_instances(case):
    # Small enough to enumerate: table-wise, column-wise and row-wise on 3 devices, memory binding.
    cfg = tiny(TINY_INSTANCES[case], hbm_gib=0.0115, shardings="[table_wise,column_wise,row_wise]")
    cost = CostModel.from_config(cfg)
    options = all_options(cfg, cost)
    best = brute_force_makespan(cost.topo, cost.capacity, unpruned_options(cfg, cost))
    p = IlpProblem(cost.topo, cost.capacity, options, tuple(t.name for t in cfg.model.tables), 30, 0.0, 0.0)
    warm = list(greedy_place(cost.topo, cost.capacity, options, p.names))
    placed, bound, status = solve_flat(p, warm)
    loads = DeviceLoads.of(cost.topo, cost.capacity, placed)
    assert loads.over_capacity() is None
    assert float(loads.time.max()) == pytest.approx(best, rel=1e-7)
    assert best * (1 - 1e-4) <= bound <= best
    plan = make_plan(cfg)
    assert plan.solver.gap <= 1e-4 and plan.solver.status == "optimal"


def test_flat_ilp_handles_node_options_and_beats_or_ties_greedy():
    cfg = round_cfg(TINY_INSTANCES[0], "planner.mip_gap=0", "planner.costs.comm_tiebreak=0")
    greedy = make_plan(compose_cfg_like(cfg, "greedy"))
    ilp = make_plan(cfg)
    check_plan_contract(ilp)
    assert ilp.solver.objective_ms <= greedy.solver.objective_ms + 1e-9
    assert ilp.solver.gap <= 1e-4


def compose_cfg_like(cfg, algorithm: str):
    import dataclasses

    from neocfg.types import PlannerAlgorithm

    return dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, algorithm=PlannerAlgorithm(algorithm)))


@pytest.mark.parametrize("model,hardware", [("dlrm_tiny", "cpu_local"), ("criteo_kaggle", "cpu_local"),
                                            ("criteo_kaggle", "zionex_1node"), ("criteo_tb_mlperf_v1", "zionex_2node"),
                                            ("dcnv2_mlperf", "zionex_1node")])
@pytest.mark.parametrize("algorithm", ["greedy", "ilp"])
def test_presets_plan_within_memory_and_contract(model, hardware, algorithm):
    cfg = compose_cfg([f"model={model}", f"hardware={hardware}", f"planner.algorithm={algorithm}"])
    plan = make_plan(cfg)
    cost = CostModel.from_config(cfg)
    check_plan_contract(plan)
    assert all(d.host_bytes <= cost.host_capacity for d in plan.devices)
    assert all(d.hbm_bytes <= cfg.hardware.device.hbm_gib * 1024**3 for d in plan.devices)
    assert plan.solver.algorithm.startswith(algorithm)
    assert plan.dpp is not None and plan.dpp.workers >= 1


def test_dcnv2_on_zionex_16node_gap_within_5_percent():
    cfg = compose_cfg(["model=dcnv2_mlperf", "hardware=zionex_16node"])
    plan = make_plan(cfg)
    check_plan_contract(plan, hbm_capacity=40 * 1024**3)
    assert plan.solver.gap <= 0.05
    greedy = make_plan(compose_cfg_like(cfg, "greedy"))
    assert plan.solver.objective_ms <= greedy.solver.objective_ms + 1e-9


def test_prod_856_on_zionex_16node_gap_within_5_percent():
    cfg = compose_cfg(["model=prod_856", "hardware=zionex_16node"])
    plan = make_plan(cfg)
    assert len(plan.tables) == 856
    check_plan_contract(plan, hbm_capacity=40 * 1024**3)
    assert plan.solver.gap <= 0.05


def test_memory_tight_plan_uses_slower_tiers_and_never_overfills():
    cfg = compose_cfg(["model=prod_856", "hardware=zionex_2node", "planner.time_limit_s=20"])
    plan = make_plan(cfg)
    cost = CostModel.from_config(cfg)
    check_plan_contract(plan)
    assert {t.memory.value for t in plan.tables} - {"hbm"}   # does not fit in HBM alone
    assert all(d.host_bytes <= cost.host_capacity for d in plan.devices)
    assert max(d.hbm_bytes for d in plan.devices) <= 40 * 1024**3 * 0.9 + 1


def test_forced_placement_is_kept():
    cfg = compose_cfg(["model=dlrm_tiny", "hardware=zionex_1node", "+model.tables.0.ranks=[6]",
                       "+model.tables.1.ranks=[2,5]",
                       "dsi.trainer_ingest_gbs=1000"])
    plan = make_plan(cfg)
    assert [s.rank for s in plan.table("t0").shards] == [6]
    t1 = plan.table("t1")
    assert t1.sharding in (ShardingType.column_wise, ShardingType.table_column_wise)
    assert [s.rank for s in t1.shards] == [2, 5] and [s.col_offset for s in t1.shards] == [0, 8]


def test_infeasible_from_make_plan():
    with pytest.raises(InfeasibleError, match="f0"):
        make_plan(compose_cfg(["model=neo_model_f_12t", "hardware=zionex_1node"]))


def test_greedy_is_largest_first_onto_least_loaded():
    # Table-wise only, 3 devices, tables whose times are proportional to pooling: LPT puts 8 | 5+1 | 4+3 ... exactly
    rows = [("p8", 1000, 16, 8), ("p5", 1000, 16, 5), ("p4", 1000, 16, 4), ("p3", 1000, 16, 3), ("p1", 1000, 16, 1)]
    cfg = round_cfg(rows, "hardware.nodes=1", "hardware.devices_per_node=3", "planner.sharding_types=[table_wise]",
                    "planner.memory_tiers=[hbm]", "planner.algorithm=greedy")
    cost = CostModel.from_config(cfg)
    options = all_options(cfg, cost)
    placed = greedy_place(cost.topo, cost.capacity, options, [r[0] for r in rows])
    by_rank: dict[int, list[str]] = {}
    for (name, *_), p in zip(rows, placed):
        by_rank.setdefault(p.ranks[0], []).append(name)
    groups = sorted(sorted(v) for v in by_rank.values())
    assert groups == [["p1", "p4"], ["p3", "p5"], ["p8"]] or groups == [["p1", "p5"], ["p3", "p4"], ["p8"]]
    plan = make_plan(cfg)
    assert plan.solver.algorithm == "greedy" and plan.solver.lower_bound_ms <= plan.solver.objective_ms


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_small_model_on_many_devices_closes_its_gap(solver):
    # Five small tables over 16 GPUs (NeocfgShardingPlanner's test model): the exact model ran to its time limit at a
    # 3.1% gap (its own bound rises slowly over 16 identical devices). The aggregated MIP's bound, which the exact
    # model now starts from, closes the gap in a fraction of a second. Asserted on the status, not on wall time.
    rows = [("tw", 1000, 32, 1), ("cw", 2000, 32, 1), ("twcw", 1500, 32, 1), ("dp", 100, 32, 1), ("rw", 5000, 32, 1)]
    cfg = compose_cfg(["hardware=zionex_2node", tables_override(rows), "model.interaction=dcn",
                       "planner.time_limit_s=10", f"planner.solver={solver}"])
    s = plan_placement(cfg).solver
    assert s.algorithm == "ilp"
    assert s.status in ("optimal", "within_gap") and s.gap <= cfg.planner.mip_gap, s


SMALL_16 = [("tw", 1000, 32, 1), ("cw", 2000, 32, 1), ("twcw", 1500, 32, 1), ("dp", 100, 32, 1), ("rw", 5000, 32, 1)]
# One case per PlacementSource value: the method whose plan each of these keeps (planner.ilp.solve_ilp: the warm
# start unless another candidate is strictly better; the flat model at or below planner.exact_max_variables).
PLACEMENT_SOURCES = {
    # dlrm_tiny on 2 CPU ranks: the greedy plan improved by local search is already optimal
    "warm_start": lambda: compose_cfg([]),
    # the exact flat model beats the warm start and the aggregated choice (TINY_INSTANCES[0] on 8 devices, gap 0;
    # a long limit: the exact model runs in slices of a tenth of it, and on a loaded machine a 4.5 s slice can end
    # before CBC finds the better plan, which keeps the warm start)
    "ilp": lambda: round_cfg(TINY_INSTANCES[0], "planner.mip_gap=0", "planner.costs.comm_tiebreak=0",
                             "planner.time_limit_s=200"),
    # five small tables over 16 GPUs: the aggregated MIP's choice closes the gap before the exact model runs
    "ilp_choice": lambda: compose_cfg(["hardware=zionex_2node", tables_override(SMALL_16), "model.interaction=dcn",
                                       "planner.time_limit_s=10"]),
    # criteo_kaggle on 16 GPUs is decomposed; its LP relaxation's choice, placed, is within the gap
    "lp_choice": lambda: compose_cfg(["model=criteo_kaggle", "hardware=zionex_2node", "planner.time_limit_s=10"]),
    "greedy": lambda: compose_cfg(["planner.algorithm=greedy"]),
}


@pytest.mark.parametrize("source", list(PLACEMENT_SOURCES))
def test_placement_source_names_the_method_whose_plan_was_kept(source):
    s = plan_placement(PLACEMENT_SOURCES[source]()).solver
    assert s.placement_source == source, s
    assert s.lower_bound_ms <= s.objective_ms * (1 + 1e-9)


def test_placement_source_of_a_rated_plan_is_given(tmp_path):
    from neocfg.planner.estimate import rate_plan_file

    cfg = compose_cfg([])
    path = tmp_path / "plan.json"
    make_plan(cfg).save(path)
    rated = rate_plan_file(cfg, path)
    assert rated.solver.placement_source == "given" and rated.solver.algorithm == "given"


def test_placement_source_covers_every_value():
    from neocfg.planner.types import PlacementSource

    assert set(PLACEMENT_SOURCES) | {"given"} == {s.value for s in PlacementSource}


# Presets whose 16- and 128-device plans take seconds; prod_856 and prod_4096 take tens of seconds each and are checked
# by bench/bench_planner.py --devices 16 128 --max-gap 0.02 (bench/RESULTS.md, "Planner bound and gaps").
CHEAP_PRESETS = ["criteo_kaggle", "criteo_tb_mlperf_v1", "dcnv2_mlperf", "dlrm_tiny"]


@pytest.mark.parametrize("hardware", ["zionex_2node", "zionex_16node"])
@pytest.mark.parametrize("model", CHEAP_PRESETS)
def test_presets_close_to_two_percent_at_the_default_time_limit(model, hardware):
    cfg = compose_cfg([f"model={model}", f"hardware={hardware}"])
    s = plan_placement(cfg).solver
    assert s.gap <= 0.02, s
    assert s.lower_bound_ms <= s.objective_ms


def test_a_spent_time_limit_keeps_the_warm_start_and_runs_no_model(monkeypatch):
    # Every phase shares planner.time_limit_s, enumerating the options included: planning that begins with it used up
    # (here: started a whole limit ago) hands back the warm start with the combinatorial bound and starts no solver.
    from neocfg.planner import ilp
    from neocfg.planner.bounds import lower_bound
    from neocfg.planner.costs import dense_cost
    from neocfg.planner.fixed import FixedCosts
    from neocfg.planner.hiding import Hiding

    def no_solver(*args, **kwargs):
        raise AssertionError("a solver was started after the time limit")

    monkeypatch.setattr(ilp, "run_model", no_solver)
    monkeypatch.setattr(ilp, "solve_flat", no_solver)
    for path in ("planner.exact_max_variables=0", "planner.exact_max_variables=100000000"):
        cfg = compose_cfg(["model=criteo_kaggle", "hardware=zionex_2node", path])
        cost = CostModel.from_config(cfg)
        options = all_options(cfg, cost)
        s = ilp.solve_ilp(cfg, cost, options, started=time.perf_counter() - cfg.planner.time_limit_s)
        assert s.placement_source is PlacementSource.warm_start
        # (less the most any device hides behind the bottom MLP: criteo's plans overlap the outputs' all-to-all)
        hiding = Hiding.of(cfg, cost, dense_cost(cfg))
        assert hiding.on
        assert s.lower_bound_ms == lower_bound(cost.topo, options, FixedCosts.of(cost), hiding)
        assert s.seconds >= cfg.planner.time_limit_s


def test_exact_model_runs_in_slices_until_its_search_stalls(monkeypatch):
    # The flat model runs in slices of EXACT_SLICE_SHARE of the time limit, each from the best plan so far: a slice
    # that finds a better plan and was still improving late earns another; one that finds none ("stalled" once it
    # found no better plan, or its best early) ends the exact model before the time limit.
    from neocfg.planner import ilp

    cfg = round_cfg(TINY_INSTANCES[0], "planner.time_limit_s=100")
    cost = CostModel.from_config(cfg)
    options = all_options(cfg, cost)
    p = IlpProblem(cost.topo, cost.capacity, options, tuple(t.name for t in cfg.model.tables), 100, 0.0, 0.0)
    warm = list(greedy_place(cost.topo, cost.capacity, options, p.names))
    worse = [dataclasses.replace(pl, option=max(opts, key=lambda o: o.perf.total)) for pl, opts in zip(warm, options)]
    script = {"improving": [(warm, "feasible"), (warm, "feasible")], "stalled": [(warm, "stalled"), (warm, "feasible")]}
    for case, outcomes in script.items():
        slices = []

        def fake_flat(exact, start):
            slices.append(exact.deadline - time.perf_counter())
            placed, status = outcomes[len(slices) - 1]
            return placed, 0.0, status

        monkeypatch.setattr(ilp, "solve_flat", fake_flat)
        found, _, status = ilp.solve_exact(p, worse, 0.0, time.perf_counter() + 100)
        assert all(s <= ilp.EXACT_SLICE_SHARE * 100 + 1e-6 for s in slices), slices
        # improving: the first slice beats the start, the second finds nothing better than its own start -> stalled
        assert len(slices) == (2 if case == "improving" else 1), (case, slices)
        assert status == "stalled" and found and found[0] is warm
