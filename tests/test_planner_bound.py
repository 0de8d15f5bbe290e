"""The reported lower bound holds for every plan of the enumerated options, fixed costs included.

On instances small enough to enumerate, with non-zero collective latency, kernel and routing costs:
  bound <= the brute-force optimum (step time straight from the cost model) <= the reported objective,
for the flat exact ILP (which must also reach the optimum) and for the decomposed path; the fixed costs the solvers
carry add up to the cost model's exactly; random instances (hypothesis) check both paths against brute force."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from neocfg.errors import NeocfgError
from neocfg.planner.assemble import assemble
from neocfg.planner.costs import CostModel, dense_cost
from neocfg.planner.fixed import FixedCosts, restricted_sharding_types
from neocfg.planner.ilp_problem import IlpProblem
from neocfg.planner.options import all_options
from neocfg.planner.pipeline import plan_placement
from neocfg.planner.types import PlacementSource, SolveResult

from conftest import compose_cfg
from planner_helpers import all_plans, brute_force_step, count_plans, round_cfg, step_by_cost_model

# Fixed costs of the size that decide plans (collective latency comparable to a table's exchange).
FIXED = ["hardware.collective_latency_us=100", "hardware.device.routing_us_per_step=10"]
KERNEL_5 = "hardware.device.kernel_overhead_us=5"
# 2 nodes x 2 devices, a batch large enough that pieces cost about as much as the fixed terms.
SMALL = ["hardware.devices_per_node=2", "train.batch_size=20000", "planner.mip_gap=0",
         "planner.costs.comm_tiebreak=0"]
FLAT = "planner.exact_max_variables=100000"
# Float summation order differs between the bound's terms and the cost model's: one part in 1e12 is rounding.
ROUND = 1 + 1e-12
DECOMPOSED = "planner.exact_max_variables=0"
INSTANCES = {
    # every sharding type, one tier: kinds and pieces decide
    "all_types": ([("a", 30_000, 16, 4), ("b", 8_000, 16, 1), ("c", 2_000, 8, 6)],
                  ["planner.memory_tiers=[hbm]", KERNEL_5]),
    # two tiers and two precisions
    "tiers": ([("a", 30_000, 16, 4), ("b", 8_000, 16, 1)],
              ["planner.memory_tiers=[hbm,host]", "planner.weights_dtypes=[fp32,fp16]", KERNEL_5,
               "planner.sharding_types=[table_wise,column_wise,row_wise]"]),
    # lookup groups decide: two fp32 and two fp16 tables on 2 devices; ignoring the kernels of a second TBE group,
    # fp32 + fp16 on each device balances best, but one precision per device is faster
    "groups": ([(name, 1000, 16, 1) for name in "abcd"],
               ["hardware.nodes=1", "hardware.device.kernel_overhead_us=100", "planner.sharding_types=[table_wise]",
                "planner.memory_tiers=[hbm]", "planner.weights_dtypes=[fp32,fp16]",
                "+model.tables.0.weights_dtypes=[fp32]", "+model.tables.1.weights_dtypes=[fp32]",
                "+model.tables.2.weights_dtypes=[fp16]", "+model.tables.3.weights_dtypes=[fp16]"]),
}


def solved(cfg):
    cost = CostModel.from_config(cfg)
    dense = dense_cost(cfg).perf.total
    options = all_options(cfg, cost)
    return cost, dense, options, plan_placement(cfg)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
@pytest.mark.parametrize("path", [FLAT, DECOMPOSED])
@pytest.mark.parametrize("name", list(INSTANCES))
def test_bound_below_brute_force_optimum_below_objective(name, path, solver):
    rows, extra = INSTANCES[name]
    cfg = round_cfg(rows, *FIXED, *SMALL, *extra, path, f"planner.solver={solver}")
    cost, dense, options, plan = solved(cfg)
    best = brute_force_step(cost, dense, options)
    s = plan.solver
    assert s.lower_bound_ms <= best * ROUND and best <= s.objective_ms * ROUND
    if path == FLAT:
        assert s.objective_ms == pytest.approx(best, rel=1e-9)
        assert s.algorithm == "ilp"
    assert s.objective_ms == pytest.approx(plan.estimate.step_ms, rel=1e-12)


@pytest.mark.parametrize("name", list(INSTANCES))
def test_fixed_costs_reproduce_the_cost_model(name):
    rows, extra = INSTANCES[name]
    cfg = round_cfg(rows, *FIXED, *SMALL, *extra)
    cost = CostModel.from_config(cfg)
    dense = dense_cost(cfg)
    options = all_options(cfg, cost)
    p = IlpProblem(cost.topo, cost.capacity, options, tuple(t.name for t in cfg.model.tables), 1, 0.0, 0.0,
                   fixed=FixedCosts.of(cost))
    plans = list(all_plans(cost.topo, options))
    rng = random.Random(0)
    for combo in rng.sample(plans, min(300, len(plans))):
        expected = step_by_cost_model(cost, dense.perf.total, combo)
        assert p.makespan(combo) + dense.perf.total == pytest.approx(expected, rel=1e-12)
        result = SolveResult(tuple(combo), "test", "n/a", 0.0, 0.0, PlacementSource.greedy)
        assert assemble(cfg, cost, dense, result).estimate.step_ms == pytest.approx(expected, rel=1e-12)


def test_restricted_sharding_types_never_beat_the_full_bound():
    # The example: with only table-wise and column-wise a plan of 2.970 ms existed below the old "bound".
    base = ["model=dcnv2_mlperf", "hardware=zionex_2node", "planner.time_limit_s=20"]
    full = plan_placement(compose_cfg(base))
    restricted = plan_placement(compose_cfg(base + ["planner.sharding_types=[table_wise,column_wise]"]))
    assert full.solver.lower_bound_ms <= restricted.solver.objective_ms
    assert full.solver.lower_bound_ms <= full.solver.objective_ms
    # the full run's plan is within its gap of the restricted one
    assert full.solver.objective_ms * (1 - full.solver.gap) <= restricted.solver.objective_ms + 1e-12


@pytest.mark.parametrize("path", [FLAT, DECOMPOSED])
def test_every_restriction_of_sharding_types_stays_above_the_full_bound(path):
    # The bound's promise on a small instance, for every restriction that changes the collectives issued (what
    # bench_planner.py --restricted checks on the bench instances): each restricted plan is a plan of the full option
    # space, so it can't beat the full run's bound, and the full plan is within its gap of the best of them.
    rows, extra = INSTANCES["all_types"]
    base = [*FIXED, *SMALL, *extra, path]
    full = plan_placement(round_cfg(rows, *base)).solver
    found = []
    for kinds in restricted_sharding_types():
        types = ",".join(k.value for k in kinds)
        try:
            found.append(plan_placement(round_cfg(rows, *base, f"planner.sharding_types=[{types}]")).solver)
        except NeocfgError:
            continue   # nothing of this restriction fits
    assert len(found) >= 4
    assert all(full.lower_bound_ms <= r.objective_ms * ROUND for r in found)
    assert full.objective_ms * (1 - full.gap) <= min(r.objective_ms for r in found) * ROUND


KINDS = ["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "data_parallel"]
table_rows = st.tuples(st.integers(500, 60_000), st.sampled_from([8, 16, 32]), st.integers(1, 12))


@settings(max_examples=int(os.environ.get("NEOCFG_HYP_EXAMPLES", "25")), deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tables=st.lists(table_rows, min_size=2, max_size=3), nodes=st.integers(1, 2), per_node=st.integers(2, 3),
       latency=st.sampled_from([0, 20, 100]), kernel=st.sampled_from([0, 5, 20]), routing=st.sampled_from([0, 10]),
       kinds=st.sets(st.sampled_from(KINDS), min_size=1), batch=st.sampled_from([2_000, 20_000]))
# the shape on which an earlier version's exact-model bound was wrong: 2 nodes x 3 devices, 5 us kernels
@example(tables=[(4_000, 16, 3), (900, 8, 1)], nodes=2, per_node=3, latency=20, kernel=5, routing=0,
         kinds={"table_wise", "column_wise", "row_wise"}, batch=2_000)
def test_random_instances_flat_and_decomposed_against_brute_force(tables, nodes, per_node, latency, kernel, routing,
                                                                 kinds, batch):
    rows = [(f"t{i}", n, d, pf) for i, (n, d, pf) in enumerate(tables)]
    common = [f"hardware.nodes={nodes}", f"hardware.devices_per_node={per_node}", f"train.batch_size={batch}",
              f"hardware.collective_latency_us={latency}", f"hardware.device.kernel_overhead_us={kernel}",
              f"hardware.device.routing_us_per_step={routing}", "planner.mip_gap=0",
              "planner.costs.comm_tiebreak=0", "planner.memory_tiers=[hbm]",
              f"planner.sharding_types=[{','.join(sorted(kinds))}]"]
    cfg = round_cfg(rows, *common, FLAT)
    cost = CostModel.from_config(cfg)
    options = all_options(cfg, cost)
    assume(count_plans(cost.topo, options) <= 6_000)
    dense = dense_cost(cfg).perf.total
    best = brute_force_step(cost, dense, options)
    flat = plan_placement(cfg).solver
    assert flat.lower_bound_ms <= best * ROUND and best <= flat.objective_ms * ROUND
    assert flat.objective_ms == pytest.approx(best, rel=1e-9)
    decomposed = plan_placement(dataclasses.replace(
        cfg, planner=dataclasses.replace(cfg.planner, exact_max_variables=0))).solver
    assert decomposed.lower_bound_ms <= best * ROUND and best <= decomposed.objective_ms * ROUND
