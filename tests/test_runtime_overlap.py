"""Under the plan's output_overlap (StepStrategies), the pooled outputs' all-to-all overlaps the bottom MLP, both ways: the forward sends it before the bottom MLP
runs and waits for it after (at the interaction); the backward sends the gradients' all-to-all before the bottom
MLP's backward and waits for it after. The losses stay those of the step without overlap (the runtime
correctness tests check the trained state against one process)."""

from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from neocfg.data.source import SyntheticSource
from neocfg.data.synthetic import SyntheticData
from neocfg.planner.strategies import with_strategies
from neocfg.runtime.plans import rule_plan
from neocfg.types import ShardingType as S

B = 8


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _LoggedWork:
    def __init__(self, work, log: list[str], what: str) -> None:
        self.work, self.log, self.what = work, log, what

    def wait(self, *args):
        self.log.append(f"{self.what} waited")
        return self.work.wait(*args)


def _trainer(sync: str, overlap: str = "auto"):
    from neocfg.runtime.train import Trainer

    cfg = compose_cfg(["model=dlrm_tiny", f"train.batch_size={B}", "train.steps=6", f"train.dense_grad_sync={sync}",
                       f"train.output_overlap={overlap}"])
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=B, sharding=S.table_wise)
    source = SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, B, cycle=3)
    return Trainer(cfg, with_strategies(cfg, plan, source_prefetches=False), None, torch.device("cpu"), source=source)


def _logged_step(trainer, monkeypatch) -> list[str]:
    """One step's order of: the exchange group's all-to-alls sent (outputs forward, gradients backward) and waited
    for, the bottom MLP's forward and the end of its backward (its first layer's weight gradient)."""
    import torch.distributed as dist

    log: list[str] = []
    real = dist.all_to_all_single
    sent = []

    def a2a(*args, group=None, async_op=False, **kw):
        work = real(*args, group=group, async_op=async_op, **kw)
        if group is not trainer.comm.group:   # the ids' all-to-alls
            return work
        what = "outputs" if not sent else "grads"
        sent.append(what)
        log.append(f"{what} sent")
        return _LoggedWork(work, log, what) if async_op else work

    monkeypatch.setattr(dist, "all_to_all_single", a2a)
    first = trainer.dense.bottom[0]
    h1 = trainer.dense.bottom.register_forward_hook(lambda *a: log.append("bottom forward"))
    h2 = first.weight.register_hook(lambda g: log.append("bottom backward"))
    try:
        trainer.train_step()
    finally:
        h1.remove()
        h2.remove()
        monkeypatch.setattr(dist, "all_to_all_single", real)
    return log


def test_outputs_all_to_all_overlaps_the_bottom_mlp_both_ways(one_rank_gloo, monkeypatch):
    trainer = _trainer("ddp", "overlap")   # (auto on these CPU ranks: dlrm_tiny's bottom MLP covers too little)
    trainer.train_step()
    assert _logged_step(trainer, monkeypatch) == [
        "outputs sent", "bottom forward", "outputs waited", "grads sent", "bottom backward", "grads waited"]


def test_no_overlap_when_the_dense_gradients_ride_in_the_exchange(one_rank_gloo, monkeypatch):
    """dense_grad_sync=exchange: the dense backward completes before the exchange's backward carries its
    gradients, so the exchange is not left in flight."""
    trainer = _trainer("exchange")
    trainer.train_step()
    assert _logged_step(trainer, monkeypatch) == ["outputs sent", "bottom forward", "bottom backward", "grads sent"]


def test_the_plan_says_wait_and_nothing_is_left_in_flight(one_rank_gloo, monkeypatch):
    """train.output_overlap=wait under DDP: the plan says so, and the runtime waits for each all-to-all at once (no
    async all-to-all on the exchange group, no PendingPooled) although it could overlap them."""
    from neocfg.runtime.dist import PendingPooled

    trainer = _trainer("ddp", "wait")
    assert trainer.plan.strategies.output_overlap is False
    made = []
    real_init = PendingPooled.__init__

    def counted(self, *args, **kw):
        made.append(self)
        real_init(self, *args, **kw)

    monkeypatch.setattr(PendingPooled, "__init__", counted)
    trainer.train_step()
    log = _logged_step(trainer, monkeypatch)
    assert not made and not any("waited" in x for x in log)
    assert log[:2] == ["outputs sent", "bottom forward"] and "grads sent" in log


def test_overlapped_steps_lose_what_plain_steps_lose(one_rank_gloo):
    """The same losses with the pooled outputs waited for at once (the plan's output_overlap off)."""
    torch.manual_seed(0)
    a, b = _trainer("ddp", "overlap"), _trainer("ddp", "wait")
    assert a.plan.strategies.output_overlap and not b.plan.strategies.output_overlap
    for _ in range(4):
        assert float(a.train_step()[0]) == float(b.train_step()[0])


def test_a_plan_that_overlaps_an_exchange_carrying_dense_gradients_is_refused(one_rank_gloo):
    """A plan's output_overlap=true with dense_grad_sync=exchange (the backward all-to-all then waits for the whole
    dense backward): the Trainer refuses it by the plan validator's rule (plan_check.strategies_fault), one line
    naming the strategy."""
    import dataclasses

    from neocfg.plan_check import PlanError
    from neocfg.runtime.train import Trainer

    cfg = compose_cfg(["model=dlrm_tiny", f"train.batch_size={B}", "train.dense_grad_sync=exchange"])
    plan = with_strategies(cfg, rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=B,
                                          sharding=S.table_wise), source_prefetches=False)
    bad = dataclasses.replace(plan, strategies=dataclasses.replace(plan.strategies, output_overlap=True))
    source = SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, B, cycle=3)
    with pytest.raises(PlanError, match=r"strategies: output_overlap=true with dense_grad_sync=exchange.*allowed"):
        Trainer(cfg, bad, None, torch.device("cpu"), source=source)
