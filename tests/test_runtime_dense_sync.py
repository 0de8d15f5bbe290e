"""train.dense_grad_sync: a small dense part's gradients ride in the embeddings' backward all-to-all (DenseGrads,
EmbeddingExchange's rider) instead of DDP's all-reduce, and train the same as under DDP, also with the all-to-all
in fp16 (the gradients travel as raw fp32 bits). Sharded == unsharded with either path: test_runtime_correctness
(auto folds every case with an all-to-all output there; row-wise-only and data-parallel-only cases run DDP)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import compose_cfg
from neocfg.errors import ConfigError
from neocfg.planner.strategies import DENSE_FOLD_MAX_BYTES, dense_grad_sync
from neocfg.runtime.plans import rule_plan
from neocfg.types import Backend, CommDtype, DenseGradSync, DenseOptimizer, ShardingType as S

STEPS = 3
BATCH = 16


def _train(env, jobs):
    """Rank fn: per (cfg, plan), the losses, the dense weights and whether DDP ran."""
    from torch.nn.parallel import DistributedDataParallel

    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import Trainer

    out = []
    for cfg, plan in jobs:
        trainer = Trainer(cfg, with_strategies(cfg, plan), None, env.device)
        result = trainer.run(resume=False, show_progress=False)
        out.append({"losses": result.losses, "ddp": isinstance(trainer.model, DistributedDataParallel),
                    "dense": {k: v.clone() for k, v in trainer.dense.state_dict().items()}})
    return out


def test_folded_dense_gradients_train_as_ddp():
    from neocfg.runtime.launch import launch

    cfg = compose_cfg([f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_batches=0",
                       "train.log_every=100"])
    # SGD on the dense part: its update is linear in the gradient, so a wrong average (a sum, one rank's own
    # gradient) shows in the weights (Adagrad's lr * g / sqrt(sum g^2) hides a factor)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dense_optimizer=DenseOptimizer.sgd,
                                                             dense_learning_rate=0.5))
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=BATCH, sharding=S.table_wise)
    fp16 = dataclasses.replace(plan, a2a_fwd_dtype=CommDtype.fp16, a2a_bwd_dtype=CommDtype.fp16)
    jobs = [(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dense_grad_sync=sync)), p)
            for p in (plan, fp16) for sync in (DenseGradSync.exchange, DenseGradSync.ddp)]
    ranks = launch(_train, (jobs,), world=2, backend=Backend.gloo, timeout_s=120)
    init = _initial_dense(cfg)
    for j in (0, 2):   # (exchange, ddp) in fp32, then in fp16
        folded, ddp = [r[j] for r in ranks], [r[j + 1] for r in ranks]
        assert not any(f["ddp"] for f in folded) and all(d["ddp"] for d in ddp)
        assert folded[0]["losses"] == folded[1]["losses"]
        torch.testing.assert_close(folded[0]["losses"], ddp[0]["losses"], rtol=1e-6, atol=1e-7)
        for k, w in ddp[0]["dense"].items():
            assert torch.equal(folded[0]["dense"][k], folded[1]["dense"][k]), k   # ranks stay identical
            moved, err = float((w - init[k]).abs().max()), float((folded[0]["dense"][k] - w).abs().max())
            assert moved > 0 and err <= 1e-3 * moved, (k, err, moved)   # summation order only (0 measured)


def _initial_dense(cfg) -> dict[str, torch.Tensor]:
    from neocfg.runtime.dlrm import build_dense

    return build_dense(cfg.model, cfg.train.seed, torch.device("cpu")).state_dict()


def test_auto_folds_only_small_dense_parts_with_an_all_to_all():
    small = DENSE_FOLD_MAX_BYTES // (4 * 2)        # parameters that fit for 2 ranks
    ex, ddp = DenseGradSync.exchange, DenseGradSync.ddp
    assert dense_grad_sync(DenseGradSync.auto, small, 2, True) is ex
    assert dense_grad_sync(DenseGradSync.auto, small + 1, 2, True) is ddp
    assert dense_grad_sync(DenseGradSync.auto, small, 4, True) is ddp
    assert dense_grad_sync(DenseGradSync.auto, 10, 2, False) is ddp       # e.g. only row-wise tables
    assert dense_grad_sync(ddp, 10, 2, True) is ddp
    assert dense_grad_sync(ex, 10 * small, 2, True) is ex
    with pytest.raises(ConfigError, match="train.dense_grad_sync"):
        dense_grad_sync(ex, 10, 2, False)
