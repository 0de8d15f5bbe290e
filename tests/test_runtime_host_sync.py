"""A GPU-ready step: at most one host sync per training step, whatever the number of fused-lookup (TBE) groups.

The step runs on CPU here; every call from the runtime's modules (neocfg/runtime/) that reads a tensor back to the
host (tolist, item, cpu, numpy, and int/float/bool/index of a tensor) during Trainer.train_step is counted. On a
GPU each of them would wait for the device."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import compose_cfg
from neocfg.data.source import SyntheticSource
from neocfg.data.synthetic import SyntheticData
from neocfg.planner.strategies import with_strategies
from neocfg.runtime.plans import rule_plan
from neocfg.types import MemoryTier, ShardingType as S, WeightsDtype

HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
RUNTIME = str(Path(__file__).resolve().parent.parent / "neocfg" / "runtime")
B = 8


@contextlib.contextmanager
def host_reads():
    """Calls of HOST_READS made by code in neocfg/runtime/ on this thread: (method, file, line)."""
    calls: list[tuple[str, str, int]] = []
    me = threading.get_ident()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, fn):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            if threading.get_ident() == me and frame.f_code.co_filename.startswith(RUNTIME):
                calls.append((name, Path(frame.f_code.co_filename).name, frame.f_lineno))
            return fn(self, *args, **kwargs)
        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# The (weights precision, memory tier) of table i % 3: one fused TBE per distinct pair.
THREE_GROUPS = [(WeightsDtype.fp32, MemoryTier.hbm), (WeightsDtype.fp16, MemoryTier.hbm),
                (WeightsDtype.fp32, MemoryTier.host)]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("sharding", [S.table_wise, S.row_wise])
def test_one_host_sync_per_step_whatever_the_groups(one_rank_gloo, groups, sharding):
    from neocfg.runtime.train import Trainer

    cfg = compose_cfg(["model=dlrm_tiny", f"train.batch_size={B}", "train.steps=8"])
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=B, sharding=sharding)
    if groups == 3:
        plan = dataclasses.replace(plan, tables=tuple(
            dataclasses.replace(t, weights_dtype=THREE_GROUPS[i % 3][0], memory=THREE_GROUPS[i % 3][1])
            for i, t in enumerate(plan.tables)))
    source = SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, B, cycle=3)
    trainer = Trainer(cfg, with_strategies(cfg, plan, source_prefetches=False), None, torch.device("cpu"),
                      source=source)
    assert len(trainer.emb.tbes) == groups
    trainer.train_step()   # the first steps start the pipeline (their counts exchanged once more)
    trainer.train_step()
    for _ in range(4):
        with host_reads() as calls:
            trainer.train_step()
        assert len(calls) == 1, calls
        assert calls[0][1] == "routing.py"   # the split sizes of the id all-to-all


def test_process_groups_are_made_once_per_purpose(one_rank_gloo, monkeypatch):
    """Each purpose (exchange, ids, replicas, ids ahead) gets one process group, made by the first Trainer of a
    process and reused by the next (on GPUs each group is an NCCL communicator); the replicas' only where some table
    is data-parallel."""
    import torch.distributed as dist

    from neocfg.runtime.train import Trainer

    cfg = compose_cfg(["model=dlrm_tiny", f"train.batch_size={B}", "train.steps=4"])
    made = []
    real = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(1) or real(*a, **k))

    def trainer(sharding):
        plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=B, sharding=sharding)
        return Trainer(cfg, with_strategies(cfg, plan, source_prefetches=False), None, torch.device("cpu"),
                       source=SyntheticSource(SyntheticData.for_model(cfg.model, 0), 0, 1, B, cycle=1))

    first = trainer(S.table_wise)
    assert len(made) == 2                    # exchange, ids (table-wise: no replicas, ids exchanged in the step)
    second = trainer(S.table_wise)
    assert len(made) == 2 and second.comm.group is first.comm.group
    trainer(S.data_parallel)
    assert len(made) == 3                    # + the replicas' all-reduce
    trainer(S.data_parallel)
    assert len(made) == 3
