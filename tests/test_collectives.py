"""The step's collectives are one list: what the plan says a step issues (neocfg.sharding.collectives, priced by the
planner) is what the ranks issue. Each rank wraps torch.distributed's collectives during a few training steps and
records every call (kind, process group, bytes in and out); the steady steps must equal the plan's list (plan.json's
`collectives`), for every sharding type, both pipelines, both dense-gradient syncs, ids exchanged in the step or a
batch ahead, both routing encodings and id dtypes, and 2 and 4 ranks (2 nodes: the two-level exchange)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import defaultdict

from conftest import compose_cfg
from neocfg.plan import Plan
from neocfg.planner.strategies import with_collectives, with_strategies
from neocfg.runtime.launch import launch
from neocfg.runtime.plans import rule_plan
from neocfg.sharding.collectives import Carries, CollectiveKind, GroupScope
from neocfg.types import (Backend, CommDtype, DenseGradSync, IdDtype, IdsExchange, RoutingEncoding, ShardingType as S,
                          WeightsDtype)

STEPS = 4
BATCH = 8
# every sharding type; table_row_wise is a reduce-scatter on one node, the two-level exchange on two
MIX = [S.table_wise, S.row_wise, S.column_wise, S.data_parallel, S.table_wise, S.row_wise, S.table_row_wise,
       S.table_column_wise]
# The torch.distributed functions wrapped in the ranks (a call inside another wrapped one is not counted twice).
WRAPPED = {"all_to_all_single": CollectiveKind.all_to_all, "reduce_scatter_single": CollectiveKind.reduce_scatter,
           "reduce_scatter_tensor": CollectiveKind.reduce_scatter, "all_gather_single": CollectiveKind.all_gather,
           "all_gather_into_tensor": CollectiveKind.all_gather, "all_reduce": CollectiveKind.all_reduce,
           "all_to_all": None, "all_gather": None, "reduce_scatter": None, "broadcast": None}


def _cfg(**train):
    cfg = compose_cfg([f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_batches=0",
                       "train.log_every=1000", "train.divergence_factor=0", "hardware=cpu_local"])
    # one id per sample and table: the id payload's bytes are the same every step (the plan counts the mean)
    model = dataclasses.replace(cfg.model, tables=[dataclasses.replace(t, pooling_factor=1.0)
                                                   for t in cfg.model.tables])
    return dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, **train))


def _job(cfg, world, per, sharding=None, fp16_table=None, **strategies):
    sh = {t.name: s for t, s in zip(cfg.model.tables, sharding or MIX)}
    plan = rule_plan(cfg.model, world=world, devices_per_node=per, batch_size=BATCH, sharding=sh,
                     a2a_fwd_dtype=strategies.pop("fwd", CommDtype.fp32),
                     a2a_bwd_dtype=strategies.pop("bwd", CommDtype.fp32))
    if fp16_table is not None:   # a second TBE group on its rank: the id counts carry each group's ids
        tables = list(plan.tables)
        tables[fp16_table] = dataclasses.replace(tables[fp16_table], weights_dtype=WeightsDtype.fp16)
        plan = dataclasses.replace(plan, tables=tuple(tables))
    plan = with_strategies(cfg, plan)
    plan = dataclasses.replace(plan, strategies=dataclasses.replace(plan.strategies, **strategies))
    # as a plan file holds it: the strategies pinned, the collectives they issue listed in plan.json
    return cfg, Plan.from_dict(json.loads(json.dumps(with_collectives(cfg, plan).to_dict())))


def _record(env, jobs):
    """Rank fn: per job, the collectives issued in each step (by the step's thread) and in the prefetch thread."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from neocfg.runtime.train import Trainer

    out = []
    for cfg, plan in jobs:
        trainer = Trainer(cfg, plan, None, env.device)
        emb = trainer.emb
        labels = {id(emb.id_group): "ids", id(trainer.comm.group): "exchange"}
        if emb.ahead_group is not None:
            labels[id(emb.ahead_group)] = "ids_ahead"
        if emb.replicated.group is not None:
            labels[id(emb.replicated.group)] = "replicas"
        if emb.xp.node_comms is not None:
            labels[id(emb.xp.node_comms.node.group)] = "node"
            labels[id(emb.xp.node_comms.cross.group)] = "cross"
        if isinstance(trainer.model, DistributedDataParallel):
            # DDP's own all-reduce, through the Python API so that the wrapper sees it (same buckets, same sums)
            trainer.model.register_comm_hook(None, allreduce_hook)
        calls: dict = {"steps": defaultdict(list), "ahead": [], "other": []}
        where = {"step": None}
        main = threading.get_ident()
        real = {name: getattr(dist, name) for name in WRAPPED}
        depth = threading.local()

        def wrap(name):
            def call(*args, **kw):
                if getattr(depth, "n", 0):
                    return real[name](*args, **kw)
                group = kw.get("group")
                label = "default" if group is None or group is dist.group.WORLD else labels.get(id(group), "?")
                if name in ("all_reduce",):
                    sent = received = args[0].numel() * args[0].element_size()
                elif WRAPPED[name] is not None:
                    out_t, in_t = args[0], args[1]
                    sent, received = in_t.numel() * in_t.element_size(), out_t.numel() * out_t.element_size()
                else:
                    sent = received = -1
                rec = (name, label, sent, received)
                if threading.get_ident() != main:
                    calls["ahead"].append(rec)
                elif where["step"] is not None:
                    calls["steps"][where["step"]].append(rec)
                else:
                    calls["other"].append(rec)
                depth.n = 1
                try:
                    return real[name](*args, **kw)
                finally:
                    depth.n = 0
            return call

        step = trainer.train_step

        def counted_step():
            where["step"] = trainer.step
            try:
                return step()
            finally:
                where["step"] = None

        trainer.train_step = counted_step
        for name in WRAPPED:
            setattr(dist, name, wrap(name))
        try:
            trainer.run(resume=False, show_progress=False)
        finally:
            for name in WRAPPED:
                setattr(dist, name, real[name])
        out.append({"steps": dict(calls["steps"]), "ahead": calls["ahead"]})
    return out


def _tally(records):
    """{(kind, group label): [calls, sent, received]} of recorded calls."""
    t: dict = defaultdict(lambda: [0, 0, 0])
    for name, label, sent, received in records:
        kind = WRAPPED[name]
        key = (kind.value if kind else name, label)
        t[key][0] += 1
        t[key][1] += sent
        t[key][2] += received
    return {k: tuple(v) for k, v in t.items()}


def _expected(plan_list, ahead: bool):
    """The plan's list tallied as the calls are (forward and backward all-to-alls of one group together)."""
    t: dict = defaultdict(lambda: [0, 0, 0])
    for c in plan_list:
        v = t[(c.kind.value, _group_of(c, ahead))]
        v[0] += c.count
        v[1] += round(c.sent)
        v[2] += round(c.received)
    return {k: tuple(v) for k, v in t.items()}


def _group_of(c, ahead):
    if c.carries in (Carries.ids, Carries.id_counts, Carries.id_weights):
        return "ids_ahead" if ahead else "ids"
    if c.carries is Carries.replica_grads:
        return "replicas"
    if c.carries is Carries.dense_grads:
        return "default"
    return {GroupScope.world: "exchange", GroupScope.intra_node: "node", GroupScope.cross_node: "cross"}[c.group]


def _check(jobs, world):
    ran = launch(_record, (jobs,), world=world, backend=Backend.gloo, timeout_s=300)
    for j, (cfg, plan) in enumerate(jobs):
        lists = plan.collectives   # plan.json's list
        assert len(lists) == world
        ahead = plan.strategies.ids_exchange is IdsExchange.prefetch
        steady = range(1, STEPS - 1)   # the pipelined step's first exchanges the counts, its last sends nothing
        ids_received = defaultdict(int)
        want_ids_received = defaultdict(int)
        for rank, (per_rank, listed) in enumerate(zip(ran, lists)):
            got_job = per_rank[j]
            want = _expected(listed, ahead)
            # the id payload's received bytes depend on where the ids' rows fall: summed over the ranks below
            ids_key = ("all_to_all", "ids_ahead" if ahead else "ids")
            if ahead:
                want.pop(ids_key)   # checked batch by batch in the prefetch thread
            for s in steady:
                got = _tally(got_job["steps"][s])
                want_in_step = dict(want)
                if not ahead:   # (ahead: nothing of the ids in the step)
                    got_ids, wanted_ids = got.pop(ids_key, None), want_in_step.pop(ids_key)
                    assert got_ids is not None, f"job {j} rank {rank} step {s}: no id payload issued"
                    assert got_ids[:2] == wanted_ids[:2], f"job {j} rank {rank} step {s}: id payload"
                    ids_received[s] += got_ids[2]
                    want_ids_received[s] += wanted_ids[2]
                assert got == want_in_step, f"job {j} ({plan.strategies.describe()}) rank {rank} step {s}"
            if ahead:   # the prefetch thread: per batch, the listed id collectives on the ahead group, nothing else
                per_batch = [c for c in listed if c.carries in (Carries.ids, Carries.id_counts)]
                calls = got_job["ahead"]
                assert calls and len(calls) % len(per_batch) == 0, f"job {j} rank {rank}: {calls}"
                for i, rec in enumerate(calls):
                    c = per_batch[i % len(per_batch)]
                    assert (WRAPPED[rec[0]], rec[1], rec[2]) == (c.kind, "ids_ahead", round(c.sent)), \
                        f"job {j} rank {rank} ahead call {i}: {rec} vs {c}"
            else:
                assert not got_job["ahead"]
        for s in steady:
            assert ids_received[s] == want_ids_received[s], f"job {j} step {s}: id payload bytes received"


def test_two_ranks_issue_the_plans_collectives():
    base = _cfg()
    jobs = [
        # pipeline off, DDP, lengths, int32, two TBE groups on a rank (the counts carry each group's ids)
        _job(base, 2, 2, fp16_table=0, pipeline=False, ids_exchange=IdsExchange.step,
             dense_grad_sync=DenseGradSync.ddp),
        # pipelined, dense gradients riding in the backward all-to-all, codes, int64, fp16 / bf16 on the wire
        _job(base, 2, 2, pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.exchange,
             id_dtype=IdDtype.int64, routing_encoding=RoutingEncoding.codes, fwd=CommDtype.fp16, bwd=CommDtype.bf16),
        # ids exchanged a batch ahead in the prefetch thread, DDP
        _job(base, 2, 2, pipeline=False, ids_exchange=IdsExchange.prefetch, dense_grad_sync=DenseGradSync.ddp),
        # every type under the other two pairings of pipeline and dense sync, and prefetched ids with the fold
        _job(base, 2, 2, pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp),
        _job(base, 2, 2, pipeline=False, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.exchange),
        _job(base, 2, 2, pipeline=False, ids_exchange=IdsExchange.prefetch, dense_grad_sync=DenseGradSync.exchange,
             fwd=CommDtype.bf16),
        # no all-to-all output at all (row-wise and data-parallel only), pipelined
        _job(base, 2, 2, sharding=[S.row_wise, S.data_parallel] * 4, pipeline=True, ids_exchange=IdsExchange.step,
             dense_grad_sync=DenseGradSync.ddp),
        # (the CPU default sends row-wise partial sums by all-to-all) by reduce-scatter, as GPUs do
        _job(base, 2, 2, pipeline=False, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp,
             sums_by_all_to_all=False),
        # two nodes of one rank: table_wise and column_wise across nodes
        _job(base, 2, 1, sharding=[S.table_wise, S.column_wise] * 4, pipeline=False, ids_exchange=IdsExchange.step,
             dense_grad_sync=DenseGradSync.exchange),
    ]
    _check(jobs, 2)


def test_four_ranks_on_two_nodes_issue_the_plans_collectives():
    base = _cfg()
    jobs = [
        _job(base, 4, 2, pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.exchange),
        _job(base, 4, 2, fp16_table=6, pipeline=False, ids_exchange=IdsExchange.step,
             dense_grad_sync=DenseGradSync.ddp, routing_encoding=RoutingEncoding.codes, fwd=CommDtype.bf16),
        _job(base, 4, 2, pipeline=False, ids_exchange=IdsExchange.prefetch, dense_grad_sync=DenseGradSync.ddp),
        _job(base, 4, 2, pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp),
        _job(base, 4, 2, pipeline=False, ids_exchange=IdsExchange.prefetch, dense_grad_sync=DenseGradSync.exchange),
        _job(base, 4, 2, pipeline=True, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp,
             sums_by_all_to_all=False),
    ]
    _check(jobs, 4)


def test_mode_plan_writes_the_steps_collectives_and_a_given_plans_are_rederived(cli, tmp_path):
    """plan.json lists every rank's collectives (here, every table table-wise under DDP: the id payload, the pooled
    outputs' all-to-all and their gradients', DDP's all-reduce), the console prints one line per collective, and a
    plan file's own list is never trusted: rating it writes the list its placement and strategies issue."""
    args = ["mode=plan", "model=dlrm_tiny", "hardware=cpu_local", "train.batch_size=64", "train.pipeline=true",
            "train.dense_grad_sync=ddp", "train.output_overlap=overlap", "planner.sharding_types=[table_wise]"]
    first = cli(*args, "hydra.run.dir=first")
    assert first.returncode == 0, first.stderr
    d = json.loads((tmp_path / "first" / "plan.json").read_text())
    cfg = compose_cfg(["model=dlrm_tiny", "hardware=cpu_local"])
    dims = {t.name: t.embedding_dim for t in cfg.model.tables}
    world, batch, fp32 = d["world_size"], 64, 4
    assert len(d["collectives"]) == world
    for rank, listed in enumerate(d["collectives"]):
        by = {(c["kind"], c["carries"]): c for c in listed}
        assert set(by) == {("all_to_all", "ids"), ("all_to_all", "outputs"), ("all_to_all", "output_grads"),
                           ("all_reduce", "dense_grads")}, listed
        held = sum(dims[t["name"]] for t in d["tables"] if t["shards"][0]["rank"] == rank)
        # pooled outputs: this rank's tables for every sample of the world out, every table for its own samples in
        assert by["all_to_all", "outputs"]["sent"] == held * batch * world * fp32
        assert by["all_to_all", "outputs"]["received"] == sum(dims.values()) * batch * fp32
        assert by["all_to_all", "ids"]["overlapped"]
        # under DDP the outputs' all-to-all and its gradients' run beside the bottom MLP (output_overlap=overlap)
        assert d["strategies"]["output_overlap"] is True
        assert by["all_to_all", "outputs"]["overlapped"] and by["all_to_all", "output_grads"]["overlapped"]
    printed = [line for line in first.stdout.splitlines() if line.startswith("  ") and " x " in line]
    assert len(printed) == 4 and any("all_reduce over world: dense grads" in line for line in printed)
    given = dict(d, collectives=[[dict(c, sent=1, count=9) for c in rank] for rank in d["collectives"]])
    (tmp_path / "given.json").write_text(json.dumps(given))
    rated = cli(*args, f"planner.plan_file={tmp_path / 'given.json'}", "hydra.run.dir=rated")
    assert rated.returncode == 0, rated.stderr
    assert json.loads((tmp_path / "rated" / "plan.json").read_text())["collectives"] == d["collectives"]


def test_weighted_ids_issue_the_listed_weights_payload(tmp_path, monkeypatch):
    """A dataset with per-id weights (dsi.columns.weights): the plan lists one more all-to-all beside the id payload,
    a float32 payload of the same split sizes, and that is what the ranks issue on the ids group; the other
    collectives are the list's as without weights."""
    from test_data_weights import MAPPING, _write

    _write(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg([f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_batches=0",
                       "train.log_every=1000", "train.divergence_factor=0", "hardware=cpu_local", *MAPPING])
    cfg, plan = _job(cfg, 2, 2, pipeline=False, ids_exchange=IdsExchange.step, dense_grad_sync=DenseGradSync.ddp)
    assert plan.strategies.id_weights
    ran = launch(_record, ([(cfg, plan)],), world=2, backend=Backend.gloo, timeout_s=300)
    id_bytes = plan.strategies.id_dtype.bytes
    for rank, (per_rank, listed) in enumerate(zip(ran, plan.collectives)):
        ids_listed = [c for c in listed if c.carries in (Carries.id_counts, Carries.ids, Carries.id_weights)]
        assert [c.carries for c in ids_listed] == [Carries.id_counts, Carries.ids, Carries.id_weights]
        for s in range(1, STEPS - 1):
            records = per_rank[0]["steps"][s]
            on_ids = [r for r in records if r[1] == "ids"]
            assert len(on_ids) == sum(c.count for c in ids_listed), f"rank {rank} step {s}: {on_ids}"
            payload, weights = on_ids[1], on_ids[2]
            assert weights[2:] == (payload[2] * 4 // id_bytes, payload[3] * 4 // id_bytes), (payload, weights)
            got, want = _tally(records), _expected(listed, False)
            got.pop(("all_to_all", "ids")), want.pop(("all_to_all", "ids"))
            assert got == want, f"rank {rank} step {s}"
