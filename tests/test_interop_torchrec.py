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
from neocfg.runtime.launch import exit_rank, free_port  # noqa: E402

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
        # Both ranks done with every collective before either tears its group down.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # results written: no interpreter teardown (a gloo thread can abort it: exit_rank)


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
    assert (hw.nodes, hw.devices_per_node, cfg.train.batch_size) == (2, 2, 128)
    # 16 GiB less TorchRec's storage reservation (15 % and the module's dense part and KJT buffers)
    assert 0.8 * 16 < hw.device.hbm_gib < 0.85 * 16
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


# ---- NeocfgShardingPlanner as a drop-in for EmbeddingShardingPlanner: each behaviour on its own ----------------------
def _sparse_nn(rows=100, dims=(64, 64, 64, 64), dtype=None, config=EmbeddingBagConfig, dense=None):
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.modules.embedding_configs import DataType

    tables = [config(num_embeddings=rows, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"],
                     data_type=dtype or DataType.FP32) for i, d in enumerate(dims)]
    kw = {} if dense is None else {"num_float_features": dense}
    return TestSparseNN(tables=tables, sparse_device=torch.device("meta"), **kw)


def _sparse_nn_of(configs):
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    return TestSparseNN(tables=list(configs), sparse_device=torch.device("meta"))


def _only(sharding_types, kernels):
    """A sharder offering these sharding types and compute kernels only."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class Only(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return list(sharding_types)

        def compute_kernels(self, sharding_type, compute_device_type):
            return list(kernels)

    return Only()


def _cuda(world=2, hbm=16 * 1024**3, local=None, **kw):
    return Topology(world_size=world, local_world_size=local or world, hbm_cap=hbm, compute_device="cuda", **kw)


def _shardings(plan, path="sparse.ebc"):
    return {n: ps for n, ps in plan.plan[path].items()}


def test_constructor_takes_torchrec_arguments_in_their_order():
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.proposers import GreedyProposer
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import Stats

    import neocfg.interop.torchrec as itr

    calls = {"enumerate": 0, "log": 0}

    class CountingEnumerator(EmbeddingEnumerator):
        def enumerate(self, module, sharders):
            calls["enumerate"] += 1
            return super().enumerate(module, sharders)

    class CountingStats(Stats):
        def log(self, sharding_plan, best_plan, **kw):
            calls["log"] += 1
            calls["tables"] = sorted(o.name for o in best_plan)

    topo = _cuda(hbm=1024**3)
    planner = NeocfgShardingPlanner(topo, 256, CountingEnumerator(topology=topo, batch_size=256),
                                    FixedPercentageStorageReservation(0.5), None, None, None, CountingStats(),
                                    {"t0": ParameterConstraints(sharding_types=["row_wise"])}, False, None, 7)
    model = _sparse_nn()
    cfg = planner.config(model, [_only(["table_wise", "row_wise"], ["fused"])])
    assert cfg.train.batch_size == 256 and cfg.planner.time_limit_s == 7
    assert cfg.hardware.device.hbm_gib == pytest.approx(0.5)   # the given reservation, not the default 15 %
    plan = planner.plan(model, [_only(["table_wise", "row_wise"], ["fused"])])
    assert calls["enumerate"] == 2 and calls["log"] == 1 and calls["tables"] == ["t0", "t1", "t2", "t3"]
    assert _shardings(plan)["t0"].sharding_type == "row_wise"   # constraints, 9th positional
    itr._WARNED.clear()
    with pytest.warns(UserWarning, match="proposer= is ignored"):
        NeocfgShardingPlanner(topo, proposer=GreedyProposer())
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="NeocfgShardingPlanner")   # once per process
        NeocfgShardingPlanner(topo, proposer=GreedyProposer())


def test_callbacks_and_plan_loader_context_check():
    from torchrec.distributed.planner.types import PlanLoader, PlannerError, PlannerErrorType

    seen = []

    def callback(options):
        seen.append(len(options))
        return options

    class Loader(PlanLoader):
        def __init__(self, h):
            self.h = h

        def load(self):
            return None

        def plan_context_hash(self):
            return self.h

        def get_plan_id(self):
            return "p"

    topo, model, sharders = _cuda(), _sparse_nn(), [_only(["table_wise"], ["fused"])]
    baseline = NeocfgShardingPlanner(topo, callbacks=[callback])
    baseline.plan(model, sharders)
    assert seen == [4]
    good = baseline.hash_planner_context_inputs_str()
    assert NeocfgShardingPlanner(topo, plan_loader=Loader(good)).plan(model, sharders).plan
    with pytest.raises(PlannerError) as e:
        NeocfgShardingPlanner(topo, plan_loader=Loader("other")).plan(model, sharders)
    assert e.value.error_type is PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH


def test_reservation_measures_the_modules_dense_part():
    """A bigger dense part leaves less memory to the tables; neocfg's own MLP guess takes none."""
    topo, sharders = _cuda(hbm=64 * 1024**2), [_only(["table_wise"], ["fused"])]
    small = NeocfgShardingPlanner(topo).config(_sparse_nn(dense=10), sharders)
    big = NeocfgShardingPlanner(topo).config(_sparse_nn(dense=4000), sharders)
    assert small.planner.dense_resident_bytes == 0 and big.planner.dense_resident_bytes == 0
    assert big.hardware.device.hbm_gib < small.hardware.device.hbm_gib
    assert small.planner.costs.hbm_reserve_fraction == 0   # the reservation's percentage replaces neocfg's


def test_fused_parameters_reach_the_parameter_sharding():
    from torchrec.distributed.types import BoundsCheckMode, CacheAlgorithm, CacheParams
    from torchrec.modules.embedding_configs import DataType

    cons = {"t0": ParameterConstraints(cache_params=CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.3),
                                       enforce_hbm=True),
            "t1": ParameterConstraints(stochastic_rounding=False, bounds_check_mode=BoundsCheckMode.FATAL),
            "t2": ParameterConstraints(output_dtype=DataType.FP16)}
    plan = _shardings(NeocfgShardingPlanner(_cuda(), constraints=cons).plan(
        _sparse_nn(), [_only(["table_wise"], ["fused", "fused_uvm_caching"])]))
    assert plan["t0"].cache_params == cons["t0"].cache_params and plan["t0"].enforce_hbm is True
    assert plan["t1"].stochastic_rounding is False and plan["t1"].bounds_check_mode is BoundsCheckMode.FATAL
    assert plan["t2"].output_dtype is DataType.FP16
    assert plan["t3"].cache_params is None and plan["t3"].enforce_hbm is None


@pytest.mark.parametrize("field,value,table_kw", [("device_group", "cpu", {}), ("data_type", None, {"dtype": "INT8"})])
def test_unplannable_tables_are_refused_naming_table_and_field(field, value, table_kw):
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
    from torchrec.modules.embedding_configs import DataType

    cons = {}
    if field == "device_group":
        cons = {"t1": ParameterConstraints(device_group=value)}
    model = _sparse_nn(dtype=DataType[table_kw["dtype"]]) if table_kw else _sparse_nn()
    with pytest.raises(PlannerError) as e:
        NeocfgShardingPlanner(_cuda(), constraints=cons).plan(model, [_only(["table_wise"], ["fused"])])
    assert e.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS
    assert field in str(e.value) and ("t1" in str(e.value) or "t0" in str(e.value))


def test_unknown_sharding_type_or_kernel_is_an_error_not_unconstrained():
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

    for c in (ParameterConstraints(sharding_types=["diagonal_wise"]), ParameterConstraints(compute_kernels=["x"])):
        with pytest.raises(PlannerError) as e:
            NeocfgShardingPlanner(_cuda(), constraints={"t2": c}).plan(_sparse_nn(), None)
        assert e.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS and "t2" in str(e.value)


def test_poolings_and_batch_sizes_scale_the_lookups():
    cons = {"t0": ParameterConstraints(pooling_factors=[2.0, 1.0], num_poolings=[3.0, 1.0], batch_sizes=[64, 256])}
    model = _sparse_nn()
    model.sparse.ebc.embedding_bag_configs()[0].feature_names.append("f0b")
    cfg = NeocfgShardingPlanner(_cuda(), batch_size=128, constraints=cons).config(model, None)
    assert cfg.model.tables[0].pooling_factor == pytest.approx(2 * 3 * 64 / 128 + 1 * 1 * 256 / 128)


def test_sharder_kernels_bound_the_plan():
    """A sharder offering only `fused` never gets a UVM kernel, even where HBM is short: it is refused instead."""
    from torchrec.distributed.planner.types import PlannerError

    model, topo = _sparse_nn(rows=20_000, dims=(128,) * 4), _cuda(hbm=24 * 1024**2)
    free = _shardings(NeocfgShardingPlanner(topo).plan(model, None))
    assert {ps.compute_kernel for ps in free.values()} & {"fused_uvm_caching", "fused_uvm"}
    with pytest.raises(PlannerError):
        NeocfgShardingPlanner(topo).plan(model, [_only(["table_wise", "row_wise"], ["fused"])])


def test_sharder_sharding_types_bound_the_plan():
    """The sharders' sharding_types() bound each table's options as TorchRec's enumerator does: a plan free to choose
    uses a type outside a narrower sharder's offer, and with that sharder every table takes one of the offered."""
    model, topo = _sparse_nn(rows=5000, dims=(16, 32, 64, 128)), _cuda(world=4, local=2)
    free = {ps.sharding_type for ps in _shardings(NeocfgShardingPlanner(topo).plan(model, None)).values()}
    for offered in (["row_wise"], ["table_wise", "data_parallel"]):
        assert free - set(offered), (free, offered)   # unbounded, the plan would leave the offer
        got = _shardings(NeocfgShardingPlanner(topo).plan(model, [_only(offered, ["fused", "dense"])]))
        assert {ps.sharding_type for ps in got.values()} <= set(offered) and len(got) == 4, got


def _rank_bytes(planner, world):
    """TorchRec's storage estimate of the chosen shards, summed per rank (HBM)."""
    per = [0] * world
    for o in planner._best_plan:
        for shard in o.shards:
            per[shard.rank] += shard.storage.hbm
    return per


def test_per_device_memory_per_rank():
    """Each rank gets its own device's memory: ten ~1 GiB tables (table-wise, HBM only) fit three 8 GiB devices and
    not the 1 GiB one, which holds only small tables; planned for the smallest device on every rank, they fit none."""
    from torchrec.distributed.planner.types import DeviceHardware, Storage

    topo = _cuda(world=4, local=2, hbm=8 * 1024**3)
    topo.devices[3] = DeviceHardware(rank=3, storage=Storage(hbm=1024**3, ddr=topo.devices[3].storage.ddr),
                                     perf=topo.devices[3].perf)
    model = _sparse_nn_of(EmbeddingBagConfig(num_embeddings=2_000_000 if i < 10 else 1000, embedding_dim=128,
                                             name=f"t{i}", feature_names=[f"f{i}"]) for i in range(14))
    tw = [_only(["table_wise"], ["fused"])]
    planner = NeocfgShardingPlanner(topo, constraints={f"t{i}": ParameterConstraints(pooling_factors=[20.0])
                                                       for i in range(14)})
    plan = _shardings(planner.plan(model, tw))
    reserved = planner._storage_reservation.reserve(topology=topo, batch_size=planner.batch_size, module=model,
                                                    sharders=tw, constraints=planner.constraints)
    used = _rank_bytes(planner, 4)
    assert all(u <= d.storage.hbm for u, d in zip(used, reserved.devices)), (used, reserved.devices)
    big = {n for n, ps in plan.items() if int(n[1:]) < 10}
    assert len(big) == 10 and all(plan[n].ranks != [3] for n in big)   # no ~1 GiB table on the 1 GiB device
    assert sum(used[:3]) > 3 * reserved.devices[3].storage.hbm   # more than the smallest device x 3: per rank
    cfg = planner.config(model, tw)
    assert cfg.hardware.nodes == 2 and cfg.hardware.devices_per_node == 2


def test_zero_ddr_and_nodes():
    no_ddr = _cuda(ddr_cap=0)
    cfg = NeocfgShardingPlanner(no_ddr).config(_sparse_nn(), None)
    assert [t.value for t in cfg.planner.memory_tiers] == ["hbm"]
    plan = _shardings(NeocfgShardingPlanner(no_ddr).plan(_sparse_nn(), None))
    assert {ps.compute_kernel for ps in plan.values()} <= {"fused", "dense"}


def test_fp16_tables_keep_their_dtype_and_may_be_data_parallel():
    from torchrec.modules.embedding_configs import DataType

    planner = NeocfgShardingPlanner(_cuda(), constraints={"t0": ParameterConstraints(sharding_types=["data_parallel"])})
    plan = _shardings(planner.plan(_sparse_nn(dtype=DataType.FP16), None))
    assert plan["t0"].sharding_type == "data_parallel"
    assert {t.weights_dtype.value for t in planner.last_plan.tables} == {"fp16"}


def test_narrow_table_one_column_shard_and_min_partition():
    cw = [_only(["column_wise"], ["fused"])]
    narrow = _shardings(NeocfgShardingPlanner(_cuda()).plan(_sparse_nn(dims=(12,)), cw))
    assert [s.shard_sizes for s in narrow["t0"].sharding_spec.shards] == [[100, 12]]
    cons = {"t0": ParameterConstraints(min_partition=16)}
    split = _shardings(NeocfgShardingPlanner(_cuda(world=4), constraints=cons).plan(_sparse_nn(dims=(64,)), cw))
    assert [s.shard_sizes[1] for s in split["t0"].sharding_spec.shards] == [16] * 4
    assert sorted(split["t0"].ranks) == [0, 1, 2, 3]


def test_empty_sharders_give_an_empty_plan():
    from torchrec.distributed.types import ShardingPlan

    assert NeocfgShardingPlanner(_cuda()).plan(_sparse_nn(), []) == ShardingPlan({})


def test_errors_are_planner_errors_of_torchrecs_types():
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

    topo = _cuda(hbm=2 * 1024**2)
    planner = NeocfgShardingPlanner(topo)
    with pytest.raises(PlannerError) as e:
        planner.plan(_sparse_nn(rows=10**6, dims=(256,)), [_only(["table_wise", "row_wise"], ["fused"])])
    assert e.value.error_type is PlannerErrorType.INSUFFICIENT_STORAGE and planner._num_proposals == 0
    with pytest.raises(PlannerError) as e:   # fits the world, not one device: table-wise only is too strict
        planner.plan(_sparse_nn(rows=4096, dims=(128,)), [_only(["table_wise"], ["fused"])])
    assert e.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS
    assert "t0 (4,096 x 128) does not fit" in str(e.value)   # neocfg's one-line reason kept


def test_plan_rates_no_worse_than_torchrecs_by_torchrecs_estimator():
    """Both planners' chosen options carry TorchRec's shard perf estimates; the busiest rank's sum is what
    EmbeddingShardingPlanner minimizes (its NoopPerfModel). neocfg's ILP over the same options is no worse."""
    def rating(planner, model, sharders):
        planner.plan(model, sharders)
        per = [0.0] * 4
        for o in planner._best_plan:
            for s in o.shards:
                per[s.rank] += s.perf.total
        return max(per)

    model = _sparse_nn(rows=5000, dims=(16, 32, 64, 128, 64, 32, 16))
    topo = _cuda(world=4, local=2)
    cons = {f"t{i}": ParameterConstraints(pooling_factors=[float(1 + 3 * i)]) for i in range(7)}
    ours = rating(NeocfgShardingPlanner(topo, 512, constraints=cons), model, None)
    from torchrec.distributed.sharding_plan import get_default_sharders

    theirs = rating(EmbeddingShardingPlanner(topo, 512, constraints=cons), model, get_default_sharders())
    assert ours <= theirs * 1.0001, (ours, theirs)


def test_offload_scaleup_proposer_keeps_its_search_space():
    """With EmbeddingOffloadScaleupProposer each table is planned in the option that proposer proposes first (TorchRec's
    proposer, loaded on the same options, says which); without it neocfg picks among all options, here others."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    topo = _cuda(world=4, local=4, hbm=64 * 1024**2)
    cons = {f"t{i}": ParameterConstraints(cache_params=CacheParams(algorithm=CacheAlgorithm.LRU),
                                          pooling_factors=[float(1 + 2 * i)]) for i in range(4)}
    model, sharders = _sparse_nn(rows=3000, dims=(32, 64, 128, 64)), [EmbeddingBagCollectionSharder()]
    proposer = EmbeddingOffloadScaleupProposer()
    proposer.load(search_space=EmbeddingEnumerator(topology=topo, batch_size=512, constraints=cons).enumerate(
        model, sharders))
    expected = {o.name: (o.sharding_type, o.compute_kernel, len(o.shards)) for o in proposer.starting_proposal}

    def chosen(planner):
        planner.plan(model, sharders)
        return {o.name: (o.sharding_type, o.compute_kernel, len(o.shards)) for o in planner._best_plan}

    assert chosen(NeocfgShardingPlanner(topo, 512, constraints=cons, proposer=EmbeddingOffloadScaleupProposer())) \
        == expected
    assert chosen(NeocfgShardingPlanner(topo, 512, constraints=cons)) != expected


def test_virtual_tables_keep_their_kernel_torchrecs_shards_and_key_value_params():
    """A virtual (key-value) table is planned in its own kernel with TorchRec's figures: the plan names that kernel,
    its shards are TorchRec's option's (the whole id space split by rank), the constraint's key-value parameters reach
    the ParameterSharding, and the plain tables beside it are planned as before."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.types import KeyValueParams
    from torchrec.modules.embedding_configs import EmbeddingConfig

    ids = 2**50   # a virtual id space no device could hold as rows
    model = _sparse_nn_of([EmbeddingConfig(num_embeddings=ids, embedding_dim=32, name="v0", feature_names=["fv0"],
                                           use_virtual_table=True, total_num_buckets=4096),
                           EmbeddingConfig(num_embeddings=4000, embedding_dim=32, name="t1", feature_names=["f1"])])
    kv = KeyValueParams(l2_cache_size=16, max_l1_cache_size=32)
    cons = {"v0": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["dram_virtual_table"],
                                       key_value_params=kv)}
    for estimator in ("torchrec", "neocfg"):
        planner = NeocfgShardingPlanner(_cuda(world=4, local=4), constraints=cons, estimator=estimator)
        plan = _shardings(planner.plan(model, [EmbeddingCollectionSharder()]), "sparse.ec")
        v = plan["v0"]
        assert v.sharding_type == "row_wise" and v.compute_kernel == "dram_virtual_table", v
        assert v.key_value_params == kv and sorted(v.ranks) == [0, 1, 2, 3]
        assert [s.shard_sizes for s in v.sharding_spec.shards] == [[ids // 4, 32]] * 4
        assert [s.shard_offsets[0] for s in v.sharding_spec.shards] == [i * ids // 4 for i in range(4)]
        assert plan["t1"].compute_kernel in ("fused", "dense") and plan["t1"].key_value_params is None
    # neocfg has no model of a virtual kernel: under its own estimator the virtual table is still priced by TorchRec's
    from neocfg.interop.torchrec import TorchRecTermsCost, stand_in_kernels, torchrec_terms
    from neocfg.planner.costs import CostModel
    from neocfg.types import MemoryTier, ShardingType, WeightsDtype

    sharders = [EmbeddingCollectionSharder()]
    space = stand_in_kernels(planner._search_space(model, sharders))
    cfg = planner.config(model, sharders)
    terms = torchrec_terms(space.options, "cuda")
    cost = TorchRecTermsCost.of(CostModel.from_config(cfg), terms, use_perf=False, theirs=space.tables)
    perf = {t.name: cost.piece(t, ShardingType.row_wise, MemoryTier.hbm, WeightsDtype.fp32, 4)[0]
            for t in cfg.model.tables}
    assert space.tables == {"v0"} and perf["v0"] == terms[("v0", "row_wise", "fused", 0)][0]
    assert perf["t1"] != terms[("t1", "row_wise", "fused", 0)][0]   # a plain table keeps neocfg's own


def test_table_with_fewer_rows_than_shards_is_row_sharded_as_torchrec_shards_it():
    """TorchRec row-shards a 3-row table over 4 ranks (its last shard empty); the drop-in offers and returns that
    option, with TorchRec's shards."""
    model = _sparse_nn_of([EmbeddingBagConfig(num_embeddings=3, embedding_dim=64, name="tiny", feature_names=["f0"]),
                           EmbeddingBagConfig(num_embeddings=400, embedding_dim=64, name="t1", feature_names=["f1"])])
    plan = _shardings(NeocfgShardingPlanner(_cuda(world=4, local=4)).plan(model, [_only(["table_row_wise"],
                                                                                       ["fused"])]))
    tiny = plan["tiny"]
    assert tiny.sharding_type == "table_row_wise" and sorted(tiny.ranks) == [0, 1, 2, 3]
    assert [s.shard_sizes for s in tiny.sharding_spec.shards] == [[1, 64], [1, 64], [1, 64], [0, 64]]


def test_bound_holds_under_torchrecs_estimator_on_the_dcnv2_tables():
    """The drop-in minimizing TorchRec's estimate (per-option comm up to ~10^4 ms, so tie-breaker coefficients of
    ~1e-11 beside per-device memory rows of ~1e10 bytes) reports a lower bound no higher than its own plan's
    step: the DLRM-DCNv2 tables over 8 GPUs at batch 512, where the exact model's bound once came out above it."""
    from omegaconf import OmegaConf
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    spec = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "dcnv2_mlperf.yaml")
    tables = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                 feature_names=[f"f_{t.name}"]) for t in spec.tables]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=spec.num_dense_features,
                 dense_arch_layer_sizes=[64, 128], over_arch_layer_sizes=[64, 1])
    cons = {t.name: ParameterConstraints(pooling_factors=[float(t.pooling_factor)]) for t in spec.tables}
    planner = NeocfgShardingPlanner(topology=Topology(world_size=8, local_world_size=8, compute_device="cuda"),
                                    batch_size=512, constraints=cons, estimator="torchrec")
    planner.plan(model, [EmbeddingBagCollectionSharder()])
    s = planner.last_plan.solver
    assert s.lower_bound_ms <= s.objective_ms, s
