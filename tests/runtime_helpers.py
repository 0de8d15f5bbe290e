"""Helpers for the runtime tests: run a plan on spawned gloo ranks and return what each rank holds, and the
single-process unsharded reference (same init, same data, the same fbgemm fused optimizer on the full tables)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from neocfg.config.schema import NeocfgConfig
from neocfg.data.source import SyntheticSource
from neocfg.data.synthetic import SyntheticData
from neocfg.plan import Plan
from neocfg.run_metrics import RunMetrics
from neocfg.runtime.dlrm import build_dense, make_dense_optimizer
from neocfg.runtime.embedding import init_rows, make_tbe
from neocfg.runtime.launch import RankEnv, launch
from neocfg.runtime.layout import GroupKey
from neocfg.types import Backend


@dataclass
class RunState:
    losses: list[float]
    tables: list[torch.Tensor]             # full tables, assembled from the shards
    optimizer: list[Optional[torch.Tensor]]  # full optimizer state per table (None for SGD)
    dense: dict[str, torch.Tensor]
    metrics: Optional[RunMetrics] = None
    replicas: int = 0                        # data-parallel replicas compared with rank 0's
    replicas_identical: bool = True          # ... and all bit-identical (weights and optimizer state)


def _rank_fn(env: RankEnv, jobs: list[tuple[NeocfgConfig, Plan]]) -> list[dict[str, Any]]:
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import Trainer

    out = []
    for cfg, plan in jobs:
        trainer = Trainer(cfg, with_strategies(cfg, plan), None, env.device)
        result = trainer.run(resume=False, show_progress=False)
        out.append({"losses": result.losses, "shards": trainer.emb.shard_state(),
                    "dense": {k: v.clone() for k, v in trainer.dense.state_dict().items()},
                    "metrics": result.metrics})
    return out


def assemble(cfg: NeocfgConfig, per_rank: list[dict[str, Any]]) -> tuple[list[torch.Tensor], list]:
    """Full tables (and optimizer states) from every rank's shards; never-written entries stay NaN."""
    tables = [torch.full((t.num_embeddings, t.embedding_dim), float("nan")) for t in cfg.model.tables]
    opt: list[Optional[torch.Tensor]] = [None] * len(tables)
    for r in per_rank:
        for s in r["shards"]:
            t, r0, c0 = s["table"], s["row_offset"], s["col_offset"]
            w = s["weights"].float()
            tables[t][r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
            if not s["optimizer"]:
                continue
            o = s["optimizer"][0].float()
            rowwise = o.dim() == 1   # one accumulator per row, else one per weight
            if opt[t] is None:
                opt[t] = torch.full(tables[t].shape[:1] if rowwise else tables[t].shape, float("nan"))
            if rowwise:
                opt[t][r0:r0 + o.shape[0]] = o
            else:
                opt[t][r0:r0 + o.shape[0], c0:c0 + o.shape[1]] = o
    return tables, opt


def compare_replicas(per_rank: list[dict[str, Any]]) -> tuple[int, bool]:
    """Shards held by several ranks at the same place (data-parallel replicas): how many copies were compared with
    the first one, and whether all are bit-identical."""
    first: dict[tuple, dict[str, Any]] = {}
    count, identical = 0, True
    for r in per_rank:
        for s in r["shards"]:
            key = (s["table"], s["row_offset"], s["col_offset"])
            if key not in first:
                first[key] = s
                continue
            count += 1
            ref = first[key]
            identical &= torch.equal(ref["weights"], s["weights"]) and all(
                torch.equal(a, b) for a, b in zip(ref["optimizer"], s["optimizer"]))
    return count, identical


def run_sharded(jobs: list[tuple[NeocfgConfig, Plan]], world: int) -> list[RunState]:
    """Run every (cfg, plan) in turn on one spawn of `world` gloo ranks."""
    per_rank = launch(_rank_fn, (jobs,), world=world, backend=Backend.gloo, timeout_s=120)
    states = []
    for j, (cfg, _) in enumerate(jobs):
        ranks = [r[j] for r in per_rank]
        tables, opt = assemble(cfg, ranks)
        replicas, identical = compare_replicas(ranks)
        states.append(RunState(ranks[0]["losses"], tables, opt, ranks[0]["dense"], ranks[0]["metrics"], replicas,
                               identical))
    return states


def run_reference(cfg: NeocfgConfig, world: int) -> RunState:
    """One process, unsharded tables in one fused TBE, global batch = world x batch_size."""
    tc = cfg.train
    tables = cfg.model.tables
    source = SyntheticSource(SyntheticData.for_model(cfg.model, cfg.dsi.seed), 0, 1, tc.batch_size * world,
                             num_samples=cfg.dsi.num_samples)
    tbe = make_tbe([(t.num_embeddings, t.embedding_dim) for t in tables], GroupKey("fp32", "hbm"), tc,
                   torch.device("cpu"))
    for i, (t, w) in enumerate(zip(tables, tbe.split_embedding_weights())):
        w.copy_(init_rows(tc.seed, i, t.num_embeddings, t.embedding_dim, 0, t.num_embeddings))
    dense = build_dense(cfg.model, tc.seed, torch.device("cpu"))
    opt = make_dense_optimizer(dense.parameters(), tc.dense_optimizer, tc.dense_learning_rate)
    losses = []
    for _ in range(tc.steps):
        batch = source.next_batch()
        pooled = tbe(batch.values, batch.offsets())
        loss = F.binary_cross_entropy_with_logits(dense(batch.dense, pooled), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    states = tbe.split_optimizer_states()
    return RunState(losses, [w.detach().clone().float() for w in tbe.split_embedding_weights()],
                    [s[0].clone() if s else None for s in states] if states else [None] * len(tables),
                    {k: v.clone() for k, v in dense.state_dict().items()})


def with_train(cfg: NeocfgConfig, **train: Any) -> NeocfgConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def assert_same_rank_state(x: dict[str, Any], y: dict[str, Any]) -> None:
    """Two ranks' checkpoint states are bit-identical: step, losses, shards with optimizer state, dense weights."""
    assert x["step"] == y["step"] and x["losses"] == y["losses"]
    for ex, ey in zip(x["embeddings"], y["embeddings"]):
        assert torch.equal(ex["weights"], ey["weights"])
        for ox, oy in zip(ex["optimizer"], ey["optimizer"]):
            assert torch.equal(ox, oy)
    for k in x["dense"]:
        assert torch.equal(x["dense"][k], y["dense"][k]), k


def train_counting_id_all_to_alls(trainer) -> int:
    """Run a Trainer to its last step; the all-to-alls it issued on its id group (in a rank process)."""
    import torch.distributed as dist

    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kw):
        if kw.get("group") is trainer.emb.id_group:
            calls.append(1)
        return real(*args, **kw)

    dist.all_to_all_single = counting
    try:
        trainer.run(resume=False, show_progress=False)
    finally:
        dist.all_to_all_single = real
    return len(calls)
