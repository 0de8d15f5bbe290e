"""The pipelined step sends one id all-to-all per step: every payload's header carries the next batch's counts
for its destination, so the receiver knows the next payload's split sizes without a counts all-to-all
(IdRouter.carry / send(then=...); Trainer._pipelined_batch). Losses and weights equal the plain step's
(tests/test_runtime_correctness.py::test_pipelined_step_equals_the_plain_one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from runtime_helpers import train_counting_id_all_to_alls
from test_runtime_routing import MIX, _batch, _reference
from neocfg.runtime.layout import build_layout
from neocfg.runtime.plans import rule_plan
from neocfg.runtime.routing import IdRouter, RwEncoding, deliver
from neocfg.types import Backend, ShardingType as S

B = 5


@pytest.mark.parametrize("encoding", [*RwEncoding])
@pytest.mark.parametrize("sharding", [S.table_wise, S.row_wise, "mix"])
def test_headers_carry_the_next_batch_counts(sharding, encoding):
    """Without a process group: payloads with the next batch's counts in their headers still deliver the reference
    bags, and the receiver reads from them exactly the recv_counts that the counts all-to-all would give for the
    next batch."""
    world = 4
    cfg = compose_cfg(["model.tables.7.num_embeddings=3", "model.tables.1.num_embeddings=10"])
    sh = {t.name: s for t, s in zip(cfg.model.tables, MIX)} if sharding == "mix" else sharding
    plan = rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=B, sharding=sh)
    layouts = [build_layout(plan, cfg.model, r) for r in range(world)]
    routers = [IdRouter(lay, B, torch.device("cpu"), encoding, torch.int32) for lay in layouts]
    now = [_batch(cfg, 100 + r) for r in range(world)]
    nxt = [_batch(cfg, 200 + r) for r in range(world)]
    routed = [rt.route(bt) for rt, bt in zip(routers, now)]
    routed_next = [rt.route(bt) for rt, bt in zip(routers, nxt)]
    for rt, r, n in zip(routers, routed, routed_next):
        rt.carry(r, n)
    for r in range(world):
        recv, recv_counts, n_codes = deliver(routed, routers, r)
        got = routers[r].receive(recv, recv_counts, n_codes, carries_next=True)
        want_counts = deliver(routed_next, routers, r)[1]
        assert torch.equal(got.next_counts, want_counts), (r, got.next_counts, want_counts)
        for (gi, go), want in zip(got.per_group, _reference(layouts[r], now, r)):
            wi, wo = want[:2]   # the reference also gives each index's weight
            assert torch.equal(go, wo) and torch.equal(gi, wi)
        assert routers[r].receive(recv, recv_counts, n_codes).next_counts is None


def _count_id_all_to_alls(env, cfg, plan):
    """Rank fn: train cfg.train.steps steps; the all-to-alls issued on the id group."""
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import Trainer

    trainer = Trainer(cfg, with_strategies(cfg, plan), None, env.device)
    return train_counting_id_all_to_alls(trainer)


def test_pipelined_step_sends_one_id_all_to_all_per_step():
    """Pipelined: the first step's counts, then one payload per step (steps + 1); plain: two per step."""
    from neocfg.runtime.launch import launch

    steps = 4
    # ids exchanged in the step (train.ids_exchange=step; under auto, with a row-sharded table, CPU ranks exchange
    # them in the prefetch thread)
    cfg = compose_cfg(["train.batch_size=16", f"train.steps={steps}", "train.eval_batches=0",
                       "train.log_every=100", "train.ids_exchange=step"])
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=16,
                     sharding={t.name: s for t, s in zip(cfg.model.tables, MIX)})
    plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pipeline=False))
    piped = launch(_count_id_all_to_alls, (cfg, plan), world=2, backend=Backend.gloo, timeout_s=120)
    unpiped = launch(_count_id_all_to_alls, (plain, plan), world=2, backend=Backend.gloo, timeout_s=120)
    assert piped == [steps + 1] * 2
    assert unpiped == [2 * steps] * 2
