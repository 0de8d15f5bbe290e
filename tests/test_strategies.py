"""The plan says what runs: the planner resolves the step's strategies (pipelining, where ids are exchanged, how
dense gradients are averaged, the id dtype, the routing encoding) into plan.json, mode=plan prints them, a user pins
them in config or in a given plan file, and the runtime runs exactly those."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from conftest import compose_cfg
from runtime_helpers import train_counting_id_all_to_alls
from neocfg.plan import Plan, StepStrategies
from neocfg.plan_check import PlanError, load_plan_file
from neocfg.planner.strategies import resolve, with_strategies
from neocfg.runtime.plans import rule_plan
from neocfg.types import Backend, DenseGradSync, IdDtype, IdsExchange, RoutingEncoding
from neocfg.types import ShardingType as S

MIX = [S.table_wise, S.row_wise, S.column_wise, S.data_parallel, S.table_wise, S.row_wise, S.table_row_wise,
       S.table_column_wise]


def _plan(cfg, sharding=None, world=2):
    sh = sharding or {t.name: s for t, s in zip(cfg.model.tables, MIX)}
    return rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=cfg.train.batch_size, sharding=sh)


def test_auto_resolves_from_config_and_placement():
    cfg = compose_cfg(["train.batch_size=16"])
    rw = resolve(cfg, _plan(cfg))
    # a row-sharded table on CPU ranks with the synthetic source: ids exchanged a batch ahead, so no pipelining
    assert (rw.ids_exchange, rw.pipeline) == (IdsExchange.prefetch, False)
    assert rw.dense_grad_sync is DenseGradSync.exchange          # dlrm_tiny's 9k dense parameters, an a2a output
    assert rw.id_dtype is IdDtype.int32 and rw.routing_encoding is RoutingEncoding.lengths
    tw = resolve(cfg, _plan(cfg, S.table_wise))
    assert (tw.ids_exchange, tw.pipeline) == (IdsExchange.step, True)
    only_rw = resolve(cfg, _plan(cfg, S.row_wise))                 # no all-to-all output: nothing to fold into
    assert only_rw.dense_grad_sync is DenseGradSync.ddp
    gpu = compose_cfg(["train.batch_size=16", "hardware=zionex_1node"])
    assert resolve(gpu, rule_plan(gpu.model, world=8, devices_per_node=8, batch_size=16,
                                  sharding=S.row_wise)).ids_exchange is IdsExchange.step   # GPU: in the step


def test_config_pins_each_choice():
    cfg = compose_cfg(["train.batch_size=16", "train.ids_exchange=step", "train.pipeline=false",
                       "train.dense_grad_sync=ddp"])
    st = resolve(cfg, _plan(cfg))
    assert (st.ids_exchange, st.pipeline, st.dense_grad_sync) == (IdsExchange.step, False, DenseGradSync.ddp)
    parquet = compose_cfg(["train.batch_size=16", "train.ids_exchange=prefetch", "dsi=parquet_local"])
    assert resolve(parquet, _plan(parquet)).ids_exchange is IdsExchange.step   # no prefetch thread to do it in


def test_output_overlap_resolves_where_it_can_run():
    """auto: the outputs' all-to-all overlaps the bottom MLP under DDP when some output comes back by all-to-all;
    not when the dense gradients ride in it, nor without one; on these CPU ranks only where the bottom MLP covers
    the exchange (dlrm_tiny's does where the overlap efficiency is 0.01, not at cpu_local's 0.5); wait pins it off;
    overlap where it cannot run is a one-line config error naming the key."""
    from neocfg.errors import ConfigError

    def st(sharding, *over):
        cfg = compose_cfg(["train.batch_size=16", *over])
        return resolve(cfg, _plan(cfg, sharding))

    covering = "hardware.output_overlap_efficiency=0.01"
    assert st(None, "train.dense_grad_sync=ddp", covering).output_overlap is True
    assert st(None, "train.dense_grad_sync=ddp").output_overlap is False          # its bottom MLP covers too little
    assert st(None, "train.dense_grad_sync=ddp", "train.output_overlap=overlap").output_overlap is True
    assert st(S.table_wise).output_overlap is False                # dlrm_tiny's auto sync folds: exchange
    assert st(S.row_wise, "train.dense_grad_sync=ddp").output_overlap is False      # no all-to-all output
    assert st(None, "train.dense_grad_sync=ddp", "train.output_overlap=wait").output_overlap is False
    with pytest.raises(ConfigError, match=r"train.output_overlap.*overlap.*dense_grad_sync resolved to exchange"):
        st(S.table_wise, "train.output_overlap=overlap")
    with pytest.raises(ConfigError, match=r"train.output_overlap.*no pooled output by all-to-all.*auto, wait"):
        st(S.row_wise, "train.dense_grad_sync=ddp", "train.output_overlap=overlap")


def test_prefetch_priority_is_idle_only_where_pinned():
    """The prefetch thread at idle priority where train.prefetch_priority pins idle, on any placement and device;
    auto and normal keep the default class; a source without the thread (a dataset) has nothing to set."""

    def idle(sharding, *over, world=2):
        cfg = compose_cfg(["train.batch_size=16", *over])
        return resolve(cfg, rule_plan(cfg.model, world=world, devices_per_node=min(world, 8), batch_size=16,
                                      sharding=sharding or {t.name: s for t, s in zip(cfg.model.tables, MIX)}
                                      )).prefetch_idle

    assert idle(S.table_wise) is False and idle(None) is False      # auto
    assert idle(S.table_wise, "train.prefetch_priority=normal") is False
    assert idle(S.table_wise, "train.prefetch_priority=idle") is True
    assert idle(None, "train.prefetch_priority=idle") is True       # ids exchanged in the thread too
    assert idle(S.table_wise, "hardware=zionex_1node", "train.prefetch_priority=idle", world=8) is True
    assert idle(S.table_wise, "dsi=parquet_local", "train.prefetch_priority=idle") is False   # no such thread


def test_partial_sums_travel_by_all_to_all_on_cpu_ranks_and_by_reduce_scatter_on_gpus():
    """auto: all_to_all on CPU devices (gloo's reduce-scatter is slow), reduce_scatter on GPUs; either pinned on any
    device; a plan with no row-wise partial sums (table-wise only) has nothing to set."""

    def a2a(sharding, *over, world=2):
        cfg = compose_cfg(["train.batch_size=16", *over])
        return resolve(cfg, rule_plan(cfg.model, world=world, devices_per_node=min(world, 8), batch_size=16,
                                      sharding=sharding or {t.name: s for t, s in zip(cfg.model.tables, MIX)}
                                      )).sums_by_all_to_all

    assert a2a(None) is True and a2a(S.row_wise) is True                       # cpu_local, auto
    assert a2a(S.row_wise, "train.partial_sums=reduce_scatter") is False
    assert a2a(S.row_wise, "hardware=zionex_1node", world=8) is False          # GPUs, auto
    assert a2a(S.row_wise, "hardware=zionex_1node", "train.partial_sums=all_to_all", world=8) is True
    assert a2a(S.table_wise, "train.partial_sums=all_to_all") is False          # no partial sums


def test_a_plan_file_without_sums_by_all_to_all_reduce_scatters_them(tmp_path):
    cfg = compose_cfg(["train.batch_size=16"])
    d = with_strategies(cfg, _plan(cfg)).to_dict()
    assert d["strategies"].pop("sums_by_all_to_all") is True
    kinds = {(c["kind"], c["carries"]) for c in d["collectives"][0]}
    assert ("all_to_all", "partial_sums") in kinds and ("reduce_scatter", "outputs") not in kinds
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    plan = load_plan_file(path, cfg.model, 2)
    assert plan.strategies.sums_by_all_to_all is False
    kinds = {(c.kind.value, c.carries.value) for c in with_strategies(cfg, plan).collectives[0]}
    assert ("reduce_scatter", "outputs") in kinds and ("all_to_all", "partial_sums") not in kinds
    d["strategies"]["sums_by_all_to_all"] = "yes"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"strategies: sums_by_all_to_all='yes' must be true or false"):
        load_plan_file(path, cfg.model, 2)


def test_an_unknown_prefetch_priority_is_a_one_line_error(cli, tmp_path):
    r = cli("mode=plan", "train.prefetch_priority=fast", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "train.prefetch_priority" in line and "fast" in line and "idle" in line and "normal" in line
    assert not (tmp_path / "run" / "plan.json").exists()


@pytest.mark.parametrize("efficiency", ["0.01", "0.5"])
def test_a_placed_plan_overlaps_exactly_where_the_rule_says(efficiency):
    """The planner resolves a placed plan's overlap from the cost model and placements it holds; that answer is the
    strategies' auto rule worked out from the plan alone (hiding.bottom_covers), covered (efficiency 0.01) or not
    (cpu_local's 0.5)."""
    from neocfg.planner.hiding import bottom_covers
    from neocfg.planner.pipeline import plan_placement

    cfg = compose_cfg(["train.batch_size=16", "train.dense_grad_sync=ddp", "planner.sharding_types=[table_wise]",
                       f"hardware.output_overlap_efficiency={efficiency}", "planner.time_limit_s=5"])
    plan = plan_placement(cfg)
    assert plan.strategies.output_overlap is bottom_covers(cfg, plan) is (efficiency == "0.01")


def test_a_plan_file_without_output_overlap_waits(tmp_path):
    """Plan files written before the key existed load, and run the exchange waited for at once."""
    cfg = compose_cfg(["train.batch_size=16", "train.dense_grad_sync=ddp", "hardware.output_overlap_efficiency=0.01"])
    d = with_strategies(cfg, _plan(cfg)).to_dict()
    assert d["strategies"].pop("output_overlap") is True
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    assert load_plan_file(path, cfg.model, 2).strategies.output_overlap is False
    d["strategies"]["output_overlap"] = "yes"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"strategies: output_overlap='yes' must be true or false"):
        load_plan_file(path, cfg.model, 2)
    d["strategies"].update(output_overlap=True, dense_grad_sync="exchange")
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"output_overlap=true with dense_grad_sync=exchange.*allowed"):
        load_plan_file(path, cfg.model, 2)


def test_a_plan_file_without_prefetch_idle_runs_the_thread_at_normal_priority(tmp_path):
    cfg = compose_cfg(["train.batch_size=16", "train.prefetch_priority=idle"])
    d = with_strategies(cfg, _plan(cfg, S.table_wise)).to_dict()
    assert d["strategies"].pop("prefetch_idle") is True
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    assert load_plan_file(path, cfg.model, 2).strategies.prefetch_idle is False
    d["strategies"]["prefetch_idle"] = 1
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"strategies: prefetch_idle=1 must be true or false"):
        load_plan_file(path, cfg.model, 2)


def test_mode_plan_writes_and_prints_them(cli, tmp_path):
    r = cli("mode=plan", "model=dlrm_tiny", "hardware=cpu_local", "train.pipeline=false", "train.ids_exchange=step",
            "train.prefetch_priority=idle", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["strategies"]["pipeline"] is False and plan["strategies"]["ids_exchange"] == "step"
    assert set(plan["strategies"]) == {f.name for f in dataclasses.fields(StepStrategies)}
    line = next(x for x in r.stdout.splitlines() if x.startswith("step: "))
    assert "pipeline off" in line and "ids exchanged in the step" in line
    assert "outputs' all-to-all waited for at once" in line       # dlrm_tiny's dense gradients ride in it
    assert plan["strategies"]["prefetch_idle"] is True and line.endswith("prefetch thread at idle priority")


def test_plan_file_strategies_are_checked(tmp_path):
    cfg = compose_cfg(["train.batch_size=16"])
    d = with_strategies(cfg, _plan(cfg)).to_dict()
    d["strategies"]["ids_exchange"] = "auto"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"strategies: ids_exchange='auto' is not one of prefetch, step"):
        load_plan_file(path, cfg.model, 2)


def _what_ran(env, cfg, plan):
    """Rank fn: the strategies the Trainer took up, and the id all-to-alls it issued over its steps."""
    from torch.nn.parallel import DistributedDataParallel

    from neocfg.runtime.train import Trainer

    trainer = Trainer(cfg, plan, None, env.device)
    pool = getattr(trainer.source, "pool", None)     # the prefetch thread's scheduling class
    policy = pool.submit(os.sched_getscheduler, 0).result() if pool is not None else None
    id_all_to_alls = train_counting_id_all_to_alls(trainer)
    router = trainer.emb.router
    return {"encoding": router.encoding, "dtype": str(router.dtype), "ids_ahead": trainer.ids_ahead,
            "ddp": isinstance(trainer.model, DistributedDataParallel), "id_all_to_alls": id_all_to_alls,
            "idle": policy == os.SCHED_IDLE}


def test_the_runtime_runs_a_plan_files_strategies(tmp_path, capsys):
    """A plan file's strategies, unlike what this config resolves to, are what the ranks run (through
    neocfg.contract.load_or_make_plan, mode=train's own way to its plan)."""
    from neocfg.contract import load_or_make_plan
    from neocfg.runtime.launch import launch

    steps = 3
    cfg = compose_cfg(["train.batch_size=16", f"train.steps={steps}", "train.eval_batches=0", "train.log_every=100"])
    plan = _plan(cfg)
    auto = resolve(cfg, plan)
    pinned = StepStrategies(pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp,
                            id_dtype=IdDtype.int64, routing_encoding=RoutingEncoding.codes, output_overlap=True,
                            prefetch_idle=True)
    assert all(getattr(pinned, f.name) != getattr(auto, f.name) for f in dataclasses.fields(StepStrategies)
               if f.name not in ("pipeline", "id_weights"))   # (no dataset here: no weights to pin)
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, strategies=pinned).save(path)
    cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, plan_file=str(path)))
    given = load_or_make_plan(cfg)
    assert given.strategies == pinned
    assert "running the plan file's strategies" in capsys.readouterr().out
    ran = launch(_what_ran, (cfg, given), world=2, backend=Backend.gloo, timeout_s=120)
    for r in ran:
        assert r["encoding"] is RoutingEncoding.codes and r["dtype"] == "torch.int64"
        assert not r["ids_ahead"] and r["ddp"] and r["idle"]
        assert r["id_all_to_alls"] == steps + 1      # pipelined: the first batch's counts, then one per step
    # ... and the same plan without its section runs what the config resolves to
    bare = load_or_make_plan(dataclasses.replace(cfg, planner=dataclasses.replace(
        cfg.planner, plan_file=str(_save(tmp_path, plan)))))
    ran = launch(_what_ran, (cfg, bare), world=2, backend=Backend.gloo, timeout_s=120)
    for r in ran:
        assert r["encoding"] is RoutingEncoding.lengths and r["dtype"] == "torch.int32"
        assert r["ids_ahead"] and not r["ddp"] and r["id_all_to_alls"] == 0   # exchanged in the prefetch thread
        assert not r["idle"]                                        # auto: the normal class


def _save(tmp_path, plan: Plan):
    path = tmp_path / "bare.json"
    plan.save(path)
    return path


def _refusal(env, cfg, plan):
    from neocfg.errors import ConfigError
    from neocfg.runtime.train import Trainer

    try:
        Trainer(cfg, plan, None, env.device)
    except ConfigError as exc:
        return str(exc)
    return None


def test_the_runtime_refuses_a_plan_without_strategies():
    from neocfg.runtime.launch import launch

    cfg = compose_cfg(["train.batch_size=16", "train.steps=1", "train.eval_batches=0"])
    said = launch(_refusal, (cfg, _plan(cfg)), world=2, backend=Backend.gloo, timeout_s=60)
    assert all(s and "no strategies section" in s for s in said), said
