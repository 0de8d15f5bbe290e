"""Candidate options per sharding type, constraints, CPU tiers, pruning and unfit tables."""

from __future__ import annotations

import pytest

from neocfg.errors import ConfigError, InfeasibleError
from neocfg.planner.costs import CostModel
from neocfg.planner.options import all_options, table_options
from neocfg.types import MemoryTier, ShardingType, WeightsDtype

from conftest import compose_cfg
from planner_helpers import round_cfg


def kinds(opts):
    return {(o.sharding, o.num_pieces) for o in opts}


def test_every_sharding_type_offered_with_its_piece_count():
    cfg = round_cfg([("t", 100_000, 64, 4)], "planner.costs.comm_tiebreak=0")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    got = kinds(opts)
    assert (ShardingType.table_wise, 1) in got
    assert (ShardingType.row_wise, 8) in got and (ShardingType.data_parallel, 8) in got
    assert (ShardingType.table_row_wise, 4) in got
    cw = {k for s, k in got if s is ShardingType.column_wise}
    assert cw and cw <= {2, 4, 8} and all(64 // k % 4 == 0 for k in cw)
    # table-column-wise (within one node of 4) is priced as column-wise, whose slices may go anywhere: pruned
    assert not {k for s, k in got if s is ShardingType.table_column_wise}
    twcw_only = round_cfg([("t", 100_000, 64, 4)], "planner.sharding_types=[table_column_wise]")
    twcw = {k for s, k in kinds(table_options(twcw_only, CostModel.from_config(twcw_only), 0))}
    assert twcw == {2, 4}
    tiers = {o.tier for o in opts}
    assert MemoryTier.hbm in tiers and all(o.dtype is WeightsDtype.fp32 for o in opts)
    assert all(o.tier is MemoryTier.hbm for o in opts if o.sharding is ShardingType.data_parallel)


def test_data_parallel_only_in_fp32_as_the_runtime_stores_replicas():
    cfg = round_cfg([("t", 100_000, 64, 4)], "planner.costs.comm_tiebreak=0", "planner.weights_dtypes=[fp32,fp16]")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    assert any(o.dtype is WeightsDtype.fp16 for o in opts)           # fp16 is offered to the other sharding types
    dp = [o for o in opts if o.sharding is ShardingType.data_parallel]
    assert dp and all(o.dtype is WeightsDtype.fp32 for o in dp)
    only_dp = round_cfg([("t", 1000, 16, 1)], "planner.sharding_types=[data_parallel]", "planner.weights_dtypes=[fp16]")
    with pytest.raises(ConfigError, match="data_parallel is its only allowed sharding type.*add fp32"):
        table_options(only_dp, CostModel.from_config(only_dp), 0)


def test_slices_keep_width_multiple_of_4():
    cfg = round_cfg([("t", 1000, 12, 1)])   # 12 columns: only 3 slices of 4 would do; 3 is no power of 2 < 8 ...
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    for o in opts:
        if o.sharding in (ShardingType.column_wise, ShardingType.table_column_wise):
            assert 12 % o.num_pieces == 0 and (12 // o.num_pieces) % 4 == 0


def test_row_wise_needs_a_row_per_rank():
    cfg = round_cfg([("t", 5, 16, 1)])       # 5 rows cannot be ceil-split over 8 ranks without an empty one
    got = kinds(table_options(cfg, CostModel.from_config(cfg), 0))
    assert not any(s is ShardingType.row_wise for s, _ in got)


def test_table_and_planner_constraints_narrow():
    cfg = round_cfg([("t", 100_000, 64, 4)], "+model.tables.0.sharding_types=[row_wise,table_wise]",
                    "planner.weights_dtypes=[fp32,fp16]", "+model.tables.0.memory_tiers=[uvm_caching]")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    assert {o.sharding for o in opts} <= {ShardingType.row_wise, ShardingType.table_wise}
    assert {o.tier for o in opts} == {MemoryTier.uvm_caching}
    assert {o.dtype for o in opts} <= {WeightsDtype.fp32, WeightsDtype.fp16}


def test_forced_ranks():
    cfg = round_cfg([("t", 1000, 16, 1)], "+model.tables.0.ranks=[5]")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    assert {o.sharding for o in opts} == {ShardingType.table_wise} and all(o.fixed_ranks == (5,) for o in opts)
    cfg = round_cfg([("t", 1000, 16, 1)], "+model.tables.0.ranks=[1,2]")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    assert {(o.sharding, o.num_pieces) for o in opts} == {(ShardingType.column_wise, 2)}   # (TWCW alike: pruned)


def test_cpu_devices_only_use_their_own_memory():
    cfg = compose_cfg(["model=dlrm_tiny", "hardware=cpu_local"])
    opts = all_options(cfg, CostModel.from_config(cfg))
    assert all(o.tier is MemoryTier.hbm for table in opts for o in table)
    with pytest.raises(ConfigError, match="planner.memory_tiers"):
        all_options(*(lambda c: (c, CostModel.from_config(c)))(
            compose_cfg(["model=dlrm_tiny", "hardware=cpu_local", "planner.memory_tiers=[host]"])))


def test_dominated_options_are_pruned():
    cfg = round_cfg([("t", 1000, 16, 1)], "planner.weights_dtypes=[fp32,fp16]")
    opts = table_options(cfg, CostModel.from_config(cfg), 0)
    # fp16 in HBM is faster and smaller than fp32 in HBM for the same sharding: fp32 HBM table-wise is dominated
    tw_hbm = [o for o in opts if o.sharding is ShardingType.table_wise and o.tier is MemoryTier.hbm]
    assert [o.dtype for o in tw_hbm] == [WeightsDtype.fp16]


def test_column_wise_prunes_table_column_wise_only_where_it_is_no_worse():
    """Column-wise slices may take any devices table-column-wise's may (distinct ones of one node) and issue the same
    all-to-all: a table-column-wise option is dropped for a column-wise one of as many slices no slower, no larger
    and in the same lookup group; where column-wise costs more (here: slower links across nodes for it alone) or is
    not allowed, table-column-wise stays."""
    cfg = round_cfg([("t", 100_000, 64, 4)], "planner.sharding_types=[column_wise,table_column_wise]")
    cost = CostModel.from_config(cfg)
    opts = table_options(cfg, cost, 0)
    assert {o.sharding for o in opts} == {ShardingType.column_wise}
    import dataclasses

    from neocfg.planner.options import prune
    twcw = next(o for o in opts if o.num_pieces == 2)
    twcw = dataclasses.replace(twcw, sharding=ShardingType.table_column_wise)
    cw = next(o for o in opts if o.num_pieces == 2)
    slower = dataclasses.replace(cw, perf=dataclasses.replace(cw.perf, fwd_comm=cw.perf.fwd_comm * 1.01))
    assert prune([cw, twcw], 0.0) == [cw]
    assert prune([slower, twcw], 0.0) == [slower, twcw]
    # a table-column-wise option never replaces a column-wise one (its slices may not leave the node)
    assert prune([twcw, cw], 0.0) == [cw]


def test_table_too_large_names_table_limit_and_fix():
    cfg = compose_cfg(["model=neo_model_f_12t", "hardware=zionex_1node"])
    with pytest.raises(InfeasibleError) as e:
        all_options(cfg, CostModel.from_config(cfg))
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg and "GiB" in msg
    assert "fp16" in msg and "hardware.nodes>=" in msg


def test_total_memory_names_limit():
    cfg = compose_cfg(["model=neo_model_f_12t", "hardware=zionex_16node"])
    with pytest.raises(InfeasibleError, match=r"need at least .* GiB .* in total.*hardware.nodes>="):
        all_options(cfg, CostModel.from_config(cfg))


def test_impossible_constraints_name_the_table():
    cfg = compose_cfg(["hardware=zionex_2node", "+model.tables.0.ranks=[3,9]",
                       "+model.tables.0.sharding_types=[table_column_wise]"])
    with pytest.raises(ConfigError, match=r"model.tables.0='t0' is invalid: no allowed way to shard it.*ranks \[3, 9\]"):
        all_options(cfg, CostModel.from_config(cfg))


def test_pruning_keeps_an_option_whose_device_hides_more_behind_the_bottom_mlp():
    """Under output_overlap a device's time is less what its bottom MLP hides of its pieces' output all-to-all
    (planner/hiding.py): an option that is faster but lets its device hide less dominates only when faster by that
    difference too."""
    import dataclasses

    from neocfg.perf import Perf
    from neocfg.planner.hiding import Hiding
    from neocfg.planner.options import prune

    cfg = round_cfg([("t", 100_000, 64, 4)], "planner.sharding_types=[column_wise,table_column_wise]")
    cost = CostModel.from_config(cfg)
    cw = next(o for o in table_options(cfg, cost, 0) if o.num_pieces == 2)
    hiding = Hiding(efficiency=1.0, bottom=Perf(fwd_compute=10.0, bwd_compute=10.0), cost=cost,
                    tables=tuple(cfg.model.tables))
    # a table-column-wise piece whose outputs' wire the bottom MLP may hide 0.01 ms more of than column-wise's
    hiding._wire.update({(0, ShardingType.column_wise, 2): (0.0, 0.0),
                         (0, ShardingType.table_column_wise, 2): (0.006, 0.004)})
    for slower_by, kept in ((0.005, 2), (0.02, 1)):
        twcw = dataclasses.replace(cw, sharding=ShardingType.table_column_wise,
                                   perf=cw.perf + Perf(fwd_comm=slower_by))
        assert prune([cw, twcw], 0.0) == [cw]
        assert len(prune([cw, twcw], 0.0, hiding)) == kept, slower_by


def test_pruning_under_cover_only_never_drops_an_option_for_one_that_adds_wire():
    """On a CPU device under output_overlap=auto a plan hides all or nothing (the bottom MLP must cover every device's
    exchange): an option that adds output wire could uncover the plan, so however much faster it is it dominates
    nothing; one that adds none still dominates as under the min() rule."""
    import dataclasses

    from neocfg.perf import Perf
    from neocfg.planner.hiding import Hiding
    from neocfg.planner.options import prune

    cfg = round_cfg([("t", 100_000, 64, 4)], "planner.sharding_types=[column_wise,table_column_wise]")
    cost = CostModel.from_config(cfg)
    cw = next(o for o in table_options(cfg, cost, 0) if o.num_pieces == 2)
    twcw = dataclasses.replace(cw, sharding=ShardingType.table_column_wise, perf=cw.perf + Perf(fwd_comm=5.0))
    for cw_wire, twcw_wire, kept in (((0.002, 0.002), (0.006, 0.004), 1),    # column-wise adds no wire
                                     ((0.006, 0.004), (0.002, 0.002), 2)):   # it adds wire: dominates nothing
        hiding = Hiding(efficiency=1.0, bottom=Perf(fwd_compute=10.0, bwd_compute=10.0), cost=cost,
                        tables=tuple(cfg.model.tables), cover_only=True)
        hiding._wire.update({(0, ShardingType.column_wise, 2): cw_wire,
                             (0, ShardingType.table_column_wise, 2): twcw_wire})
        assert len(prune([cw, twcw], 0.0, hiding)) == kept, cw_wire
        # under the min() rule (a GPU, or overlap pinned) column-wise, 5 ms faster, dominates either way
        assert prune([cw, twcw], 0.0, dataclasses.replace(hiding, cover_only=False)) == [cw]
