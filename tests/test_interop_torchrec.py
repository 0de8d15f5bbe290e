"""TorchRec's DistributedModelParallel trains a DLRM on 2 gloo ranks with a plan from neocfg
(NeocfgShardingPlanner, and the torchrec_plan.json `neocfg mode=plan planner.export=torchrec` writes), with
table-wise, column-wise, table-column-wise, data-parallel and (through CpuRowWiseEmbeddingBagCollectionSharder)
row-wise tables; the sharded model's first forward equals the unsharded model's on the same weights and batch,
and training lowers the loss. Skipped, saying why, where TorchRec is not installed (`make test` runs this file in
.venv-torchrec)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed here; `make test` runs this file in "
                                                 ".venv-torchrec (make torchrec-env)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from neocfg.interop.torchrec import (CpuRowWiseEmbeddingBagCollectionSharder, NeocfgShardingPlanner,  # noqa: E402
                                     from_sharding_plan, load_torchrec_plan, plan_json_of, to_sharding_plan)
from neocfg.interop.export import to_torchrec_dict  # noqa: E402
from neocfg.plan_check import load_plan_file  # noqa: E402
from neocfg.runtime.launch import free_port  # noqa: E402

WORLD, BATCH, STEPS, DENSE = 2, 32, 16, 13
# One table per sharding type (name, rows, dim, type); 32 columns give column slices of 16 or 8.
TABLES = [("tw", 1000, 32, "table_wise"), ("cw", 2000, 32, "column_wise"), ("twcw", 1500, 32, "table_column_wise"),
          ("dp", 100, 32, "data_parallel"), ("rw", 5000, 32, "row_wise")]
MODEL_YAML = "\n".join(
    ["name: torchrec_dlrm", "num_dense_features: 13", "tables:"]
    + [f"  - {{name: {n}, num_embeddings: {r}, embedding_dim: {d}, sharding_types: [{s}]}}" for n, r, d, s in TABLES])


def _model(device: str = "meta") -> DLRM:
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
               for n, r, d, _ in TABLES]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[32, 32],
                over_arch_layer_sizes=[32, 1])


def _sharders():
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05}
    return [CpuRowWiseEmbeddingBagCollectionSharder(fused_params=fused)]


def _batch(step: int, rank: int | None):
    """The global batch of a step (rank None) or a rank's half of it: dense features, KJT ids, labels."""
    g = torch.Generator().manual_seed(1000 + step)
    n = BATCH * WORLD
    dense = torch.randn(n, DENSE, generator=g)
    ids = [torch.randint(0, r, (n, 2), generator=g) for _, r, _, _ in TABLES]
    labels = ((dense[:, 0] + (ids[0][:, 0] % 2).float()) > 0.5).float()
    lo, hi = (0, n) if rank is None else (rank * BATCH, (rank + 1) * BATCH)
    m = hi - lo
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{name}" for name, _, _, _ in TABLES],
        values=torch.cat([x[lo:hi].reshape(-1) for x in ids]),
        lengths=torch.full((len(TABLES) * m,), 2, dtype=torch.int32))
    return dense[lo:hi], kjt, labels[lo:hi]


def _copy_reference_weights(dmp, reference: DLRM) -> None:
    ref = reference.state_dict()
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            src = ref[key]
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(src[r0:r0 + nr, c0:c0 + nc])
            else:
                value.copy_(src)


def _worker(rank: int, port: int, plan_source: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        sharders = _sharders()
        model = _model("meta")
        if plan_source == "planner":
            constraints = {n: ParameterConstraints(sharding_types=[s], pooling_factors=[2.0]) for n, _, _, s in TABLES}
            planner = NeocfgShardingPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"),
                                            batch_size=BATCH, constraints=constraints)
            plan = planner.collective_plan(model, sharders)
        else:
            plan = load_torchrec_plan(plan_source, model, sharders)
        dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, device=torch.device("cpu"))
        reference = _model("cpu")
        _copy_reference_weights(dmp, reference)
        dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                          lambda ps: torch.optim.SGD(ps, lr=0.05))
        dense, kjt, labels = _batch(0, rank)
        with torch.no_grad():
            mine = dmp(dense, kjt).squeeze(-1)
            full_dense, full_kjt, _ = _batch(0, None)
            expected = reference(full_dense, full_kjt).squeeze(-1)[rank * BATCH:(rank + 1) * BATCH]
        losses = []
        for step in range(STEPS):
            dense, kjt, labels = _batch(step % 4, rank)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(-1), labels)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            losses.append(loss.item())
        kinds = {name: ps.sharding_type for p in plan.plan.values() for name, ps in p.items()}
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps({
            "max_abs_diff": (mine - expected).abs().max().item(), "losses": losses, "kinds": kinds}))
        # Both ranks done with every collective before either tears its group down: without it, one CI run of
        # d0ff722 saw rank 0 abort in teardown ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(tmp_path: Path, plan_source: str) -> list[dict]:
    mp.spawn(_worker, args=(free_port(), plan_source, str(tmp_path)), nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(WORLD)]


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["kinds"] == {n: s for n, _, _, s in TABLES}
        assert r["max_abs_diff"] < 1e-5, r["max_abs_diff"]  # sharded forward == unsharded forward
        first, last = sum(r["losses"][:4]) / 4, sum(r["losses"][-4:]) / 4
        assert last < first, r["losses"]


def test_dmp_trains_with_neocfg_planner(tmp_path):
    _check(_train(tmp_path, "planner"))


def test_dmp_trains_with_exported_plan(tmp_path, cli):
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "torchrec_dlrm.yaml").write_text(MODEL_YAML + "\n")
    r = cli("--config-dir", str(tmp_path / "myconf"), "mode=plan", "model=torchrec_dlrm", f"train.batch_size={BATCH}",
            "planner.export=torchrec")
    assert r.returncode == 0, r.stderr
    exported = next((tmp_path / "outputs").rglob("torchrec_plan.json"))
    _check(_train(tmp_path, str(exported)))


def test_torchrec_plan_round_trip_and_rating(tmp_path):
    """TorchRec's own planner's plan -> neocfg plan (validated, rated) -> TorchRec plan: the same shardings."""
    model, sharders = _model("meta"), _sharders()
    topo = Topology(world_size=WORLD, compute_device="cpu")
    constraints = {n: ParameterConstraints(sharding_types=[s]) for n, _, _, s in TABLES}
    theirs = EmbeddingShardingPlanner(topology=topo, batch_size=BATCH, constraints=constraints).plan(model, sharders)
    planner = NeocfgShardingPlanner(topology=topo, batch_size=BATCH, constraints=constraints)
    rated = planner.rate(model, theirs, sharders)
    assert rated.solver.algorithm == "given" and rated.estimate.step_ms > 0
    assert {t.name: t.sharding.value for t in rated.tables} == {n: s for n, _, _, s in TABLES}
    back = to_sharding_plan(to_torchrec_dict(rated, "cpu"), {n: "sparse_arch.embedding_bag_collection"
                                                              for n, _, _, _ in TABLES})
    a, b = theirs.plan["sparse_arch.embedding_bag_collection"], back.plan["sparse_arch.embedding_bag_collection"]
    for name, _, _, _ in TABLES:
        assert (a[name].sharding_type, a[name].compute_kernel, a[name].ranks) == \
            (b[name].sharding_type, b[name].compute_kernel, b[name].ranks), name
        shards = (lambda ps: None if ps.sharding_spec is None else
                  [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in ps.sharding_spec.shards])
        assert shards(a[name]) == shards(b[name]), name
    again = from_sharding_plan(back, model, sharders, WORLD, WORLD, BATCH, "m")
    assert again.tables == rated.tables
    plan_json_of(theirs, model, sharders, planner, tmp_path / "plan.json")  # a plan.json mode=train can take
    assert load_plan_file(tmp_path / "plan.json", None, WORLD).tables == rated.tables


def test_planner_reads_module_constraints_and_topology():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    model = _model("meta")
    topo = Topology(world_size=4, local_world_size=2, compute_device="cuda", hbm_cap=16 * 1024**3)
    constraints = {"cw": ParameterConstraints(pooling_factors=[3.0, 2.0]),
                   "dp": ParameterConstraints(sharding_types=["data_parallel"])}
    cfg = NeocfgShardingPlanner(topology=topo, batch_size=128, constraints=constraints).config(
        model, [EmbeddingBagCollectionSharder()])
    tables = {t.name: t for t in cfg.model.tables}
    assert [(t.num_embeddings, t.embedding_dim) for t in cfg.model.tables] == [(r, d) for _, r, d, _ in TABLES]
    assert tables["cw"].pooling_factor == 5.0 and tables["tw"].pooling_factor == 1.0
    assert [s.value for s in tables["dp"].sharding_types] == ["data_parallel"]
    hw = cfg.hardware
    assert (hw.nodes, hw.devices_per_node, hw.device.hbm_gib, cfg.train.batch_size) == (2, 2, 16.0, 128)
    assert "row_wise" in [s.value for s in cfg.planner.sharding_types]  # TorchRec offers row-wise on CUDA
    from hydra import initialize
    from hydra.core.global_hydra import GlobalHydra

    with initialize(version_base=None):  # inside a user's Hydra app: its state is kept
        outer = GlobalHydra.instance().hydra
        cpu = NeocfgShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), batch_size=128).config(
            model, [EmbeddingBagCollectionSharder()])
        assert GlobalHydra.instance().hydra is outer
    assert "row_wise" not in [s.value for s in cpu.planner.sharding_types]  # ... but not on CPU


def test_small_model_over_16_gpus_plans_within_gap():
    # This module's five tables over 16 GPUs ran neocfg's exact model to its 45 s limit (gap 3.1%); the aggregated
    # MIP's bound, which the exact model starts from, closes it at once to the 2%. (At the default mip_gap of
    # 1% the cost model since calib's re-fit leaves 1.02% at the limit.) Asserted on status and gap, not wall time.
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    planner = NeocfgShardingPlanner(topology=Topology(world_size=16, local_world_size=8, compute_device="cuda"),
                                    batch_size=512, overrides=["planner.mip_gap=0.02", "planner.time_limit_s=20"])
    plan = planner.plan(_model("meta"), [EmbeddingBagCollectionSharder()])
    assert set(plan.plan["sparse_arch.embedding_bag_collection"]) == {n for n, _, _, _ in TABLES}
    s = planner.last_plan.solver
    assert s.algorithm == "ilp" and s.status in ("optimal", "within_gap") and s.gap <= 0.02, s
