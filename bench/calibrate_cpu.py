"""Measure this machine for the cpu_local hardware preset, as mode=train runs: 2 ranks at once, one thread each,
and the runtime's own code wherever there is one. Prints the values to put in conf/hardware/cpu_local.yaml.

    .venv/bin/python bench/calibrate_cpu.py [--repeats 50] [--out calib.json]
    .venv/bin/python bench/calibrate_cpu.py --only <part>

Parts: collectives (gloo alone: latency, bandwidth), step_collectives (a collective right after compute on both
ranks), tbe (neocfg.runtime.embedding.make_tbe over dlrm_tiny's tables and synthetic ids), dense (a bare MLP and the
1024^3 matmul peak), runtime_dense (neocfg's DenseArch under DDP with the fused optimizer), router (the IdRouter
alone), replica_update (a data-parallel replica's gradient and update), synthetic (batch generation alone), train (a
short mode=train run with its collectives, router and batch production timed per call), dp_all_reduce (the
data-parallel tables' all-reduce inside a mode=train step, two replica sizes), step_terms (bench/calibrate_step.py:
whole mode=train runs of calibration models, each term's laps fitted to what the cost model prices; the source of
the embedding compute, dense and data constants). Most quantities are a fit
t = a + b x over two or more sizes (a: fixed cost, b: per byte, FLOP, id or sample). Run it on an otherwise idle
machine; other jobs inflate everything, and even then repeated runs spread by 20-50 % on a shared VM: repeat it and
take medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The constants the preset is read against (neocfg.config.planner.CostConstants defaults).
HBM_EFFICIENCY = 0.5
BWD_COMPUTE_MULTIPLIER = 2.0
TRAIN_FLOPS_PER_FWD = 3
# Kernels (dispatched ops) per linear layer per training step: addmm + activation forward; two matmuls, the
# activation's gradient and the bias gradient backward; neocfg.planner.costs.DENSE_KERNELS_PER_LAYER.
KERNELS_PER_LAYER = 6
# Kernels of this MLP step outside its layers: the loss and its gradient seed, zero_grad, Adagrad's foreach update.
STEP_KERNELS = 10


def fit(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least-squares t = a + b x."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return mt - b * mx, b


def timed(fn, repeats: int, warmup: int = 5) -> float:
    """Median seconds of fn()."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


# ---------------------------------------------------------------- gloo collectives on 2 local ranks

COLL_BYTES = [64, 4096, 65536, 1 << 20, 4 << 20]   # bytes each rank sends in total


def _coll_worker(rank: int, world: int, init: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res: dict[str, list[float]] = {"all_to_all": [], "all_reduce": [], "reduce_scatter": [], "all_gather": []}
    for nbytes in COLL_BYTES:
        n = max(world, nbytes // 4 // world * world)
        x = torch.randn(n)
        y = torch.empty(n)
        small = torch.empty(n // world)
        big = torch.empty(n * world)

        def a2a():
            dist.all_to_all_single(y, x)

        def ar():
            dist.all_reduce(x)

        def rs():
            dist.reduce_scatter_single(small, x)

        def ag():
            dist.all_gather_single(big, x)

        for name, fn in (("all_to_all", a2a), ("all_reduce", ar), ("reduce_scatter", rs), ("all_gather", ag)):
            dist.barrier()
            res[name].append(timed(fn, repeats))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def collectives(repeats: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "coll.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_coll_worker, args=(2, init, repeats, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    fits = {}
    for name, ts in res.items():
        a, b = fit([float(x) for x in COLL_BYTES], ts)
        fits[name] = {"latency_us": ts[0] * 1e6, "fit_latency_us": a * 1e6,
                      "gbs": (1.0 / b / 1e9) if b > 0 else float("inf"),
                      "times_us": {str(x): t * 1e6 for x, t in zip(COLL_BYTES, ts)}}
    return fits


# ---------------------------------------------------------------- collectives as a training step meets them

# Compute before each timed collective (ms): a step issues its collectives between compute phases of this length.
STEP_COMPUTE_MS = 2.0


def _busy(ms: float, a: torch.Tensor) -> None:
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        a @ a


def _step_coll_worker(rank: int, world: int, init: str, repeats: int, out: str) -> None:
    """Each rank computes STEP_COMPUTE_MS, then issues a small collective (what the step's exchange and gradient
    all-reduces meet: the peer arrives from its own compute, the gloo threads wake on a core the ranks keep busy);
    and the same with a DDP-like all-reduce in flight on the default group (data-parallel tables' all-reduce runs
    beside DDP's)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    other = dist.new_group(backend="gloo")
    a = torch.randn(256, 256)
    x, y = torch.randn(1024), torch.empty(1024)
    inflight = torch.randn(64 * 1024)
    res: dict[str, list[float]] = {"all_to_all": [], "all_reduce": [], "all_reduce_beside_another": []}
    for _ in range(5 + repeats):
        _busy(STEP_COMPUTE_MS, a)
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x, group=other)
        res["all_to_all"].append(time.perf_counter() - t0)
        _busy(STEP_COMPUTE_MS, a)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=other)
        res["all_reduce"].append(time.perf_counter() - t0)
        work = dist.all_reduce(inflight, async_op=True)
        _busy(STEP_COMPUTE_MS / 2, a)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=other)
        res["all_reduce_beside_another"].append(time.perf_counter() - t0)
        work.wait()
    Path(f"{out}.{rank}").write_text(json.dumps({k: statistics.median(v[5:]) * 1e6 for k, v in res.items()}))
    dist.destroy_process_group()


def step_collectives(repeats: int) -> dict[str, float]:
    """Latency (us, 4 KB) of a collective issued after STEP_COMPUTE_MS of compute on both ranks; mean of ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "step")
        mp.spawn(_step_coll_worker, args=(2, f"file://{os.path.join(tmp, 'store')}", repeats, out), nprocs=2,
                 join=True)
        runs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    return {k: sum(r[k] for r in runs) / 2 for k in runs[0]}


# ---------------------------------------------------------------- fused TBE lookups (one rank, one thread)

TBE_MODEL = "dlrm_tiny"
TBE_BAGS = (512, 1024, 2048, 4096)   # bags per table per step: world x batch_size (2 ranks x 256..2048)


def tbe(repeats: int) -> dict[str, float]:
    """fbgemm's fused TBE as the runtime builds it (neocfg.runtime.embedding.make_tbe: row-wise Adagrad fused into
    the backward) over TBE_MODEL's tables (their rows, pooling and Zipf skew; ids from neocfg.data.synthetic):
    forward + backward per step, fit t = a + b x forward bytes (rows gathered x dim x 4)."""
    from neocfg.data.synthetic import SyntheticData
    from neocfg.runtime.embedding import make_tbe
    from neocfg.runtime.layout import GroupKey
    from neocfg.types import MemoryTier, WeightsDtype
    from common import compose_cfg

    torch.set_num_threads(1)
    cfg = compose_cfg([f"model={TBE_MODEL}"])
    tables = cfg.model.tables
    op = make_tbe([(t.num_embeddings, t.embedding_dim) for t in tables], GroupKey(WeightsDtype.fp32.value, MemoryTier.hbm.value),
                  cfg.train, torch.device("cpu"))
    data = SyntheticData.for_model(cfg.model, 0)
    fwd_bytes, ts = [], []
    for bags in TBE_BAGS:
        batch = data.batch(0, bags)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(batch.lengths.reshape(-1), 0)])
        ids = batch.values.long()   # rows of each table, table-major with [tables, bags] lengths: the TBE's input

        def step():
            out = op(ids, offsets)
            out.backward(torch.ones_like(out))

        ts.append(timed(step, repeats))
        fwd_bytes.append(float(ids.numel() * tables[0].embedding_dim * 4))
    a, b = fit(fwd_bytes, ts)
    # fwd+bwd = (1 + bwd_multiplier) x fwd bytes / (bandwidth x hbm_efficiency)
    eff_gbs = (1 + BWD_COMPUTE_MULTIPLIER) / b / 1e9
    return {"model": TBE_MODEL, "call_overhead_us_fwd_bwd": a * 1e6, "effective_lookup_gbs": eff_gbs,
            "hbm_bandwidth_gbs_for_preset": eff_gbs / HBM_EFFICIENCY,
            "times_us": {str(int(x)): t * 1e6 for x, t in zip(fwd_bytes, ts)}}


# ---------------------------------------------------------------- dense MLP training (one rank, one thread)

def dense(repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    widths = [512, 512, 256, 64, 16]                     # criteo_kaggle's bottom MLP shape
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.Adagrad(net.parameters(), lr=0.01)
    fwd_flops = sum(2 * a * b for a, b in zip(widths, widths[1:]))
    n_layers = len(widths) - 1
    xs, ts = [], []
    for batch in (16, 64, 256, 1024):
        x = torch.randn(batch, widths[0])

        def step():
            opt.zero_grad(set_to_none=True)
            net(x).sum().backward()
            opt.step()

        ts.append(timed(step, repeats))
        xs.append(float(batch * fwd_flops * TRAIN_FLOPS_PER_FWD))
    a, b = fit(xs, ts)
    big = torch.randn(1024, 1024)
    t_mm = timed(lambda: big @ big, max(5, repeats // 5))
    return {"train_tflops": 1.0 / b / 1e12, "matmul_peak_tflops": 2 * 1024**3 / t_mm / 1e12,
            "overhead_us_per_step": a * 1e6, "kernel_overhead_us": a * 1e6 / (n_layers * KERNELS_PER_LAYER + STEP_KERNELS),
            "times_us": {str(int(x)): t * 1e6 for x, t in zip(xs, ts)}}


# ---------------------------------------------------------------- the runtime's dense part (2 ranks, DDP)

DENSE_BATCHES = (256, 512, 1024)   # the per-rank batches the preset is checked at


def _runtime_dense_worker(rank: int, world: int, init: str, model_name: str, repeats: int, out: str) -> None:
    """neocfg.runtime.dlrm's DenseArch under DDP (DDP_OPTIONS) with the fused dense optimizer, as Trainer builds it:
    forward, BCE loss, zero_grad, backward (DDP's all-reduce), step; the pooled embeddings a leaf input."""
    from torch.nn.parallel import DistributedDataParallel

    from neocfg.runtime.dlrm import DDP_OPTIONS, build_dense, make_dense_optimizer
    from neocfg.types import DenseOptimizer
    from common import compose_cfg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = compose_cfg([f"model={model_name}"]).model
    ddp = DistributedDataParallel(build_dense(model, 0, torch.device("cpu")), **DDP_OPTIONS)
    opt = make_dense_optimizer(ddp.parameters(), DenseOptimizer.adagrad, 0.01)
    times = []
    for batch in DENSE_BATCHES:
        dense = torch.randn(batch, model.num_dense_features)
        pooled = torch.randn(batch, sum(model.embedding_dims), requires_grad=True)
        labels = torch.randint(0, 2, (batch,)).float()

        def step():
            loss = torch.nn.functional.binary_cross_entropy_with_logits(ddp(dense, pooled), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        dist.barrier()
        times.append(timed(step, repeats))
    Path(f"{out}.{rank}").write_text(json.dumps(times))
    dist.destroy_process_group()


DENSE_MODELS = ("criteo_kaggle", "dlrm_tiny")


def runtime_dense(repeats: int) -> dict[str, dict[str, float]]:
    """runtime_dense_of each of DENSE_MODELS: criteo_kaggle's MLPs give the FLOP rate, dlrm_tiny's (a few MFLOP
    per step) the fixed cost per op."""
    return {m: runtime_dense_of(repeats, m) for m in DENSE_MODELS}


def runtime_dense_of(repeats: int, model_name: str) -> dict[str, float]:
    """Training FLOP rate and fixed cost of the runtime's dense step: a fit t = a + b x train FLOPs over
    DENSE_BATCHES, 2 ranks at once (mean of the ranks)."""
    from neocfg.planner.costs import TRAIN_FLOPS_PER_FWD, dense_flops_and_params, dense_layers
    from common import compose_cfg

    cfg = compose_cfg([f"model={model_name}"])
    flops, params = dense_flops_and_params(cfg.model)
    c = cfg.planner.costs
    kernels = c.dense_kernels_per_layer * dense_layers(cfg.model) + c.dense_step_kernels
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dense")
        mp.spawn(_runtime_dense_worker, args=(2, f"file://{os.path.join(tmp, 'store')}", model_name, repeats, out),
                 nprocs=2, join=True)
        runs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    ts = [(a + b) / 2 for a, b in zip(*runs)]
    xs = [float(bt * flops * TRAIN_FLOPS_PER_FWD) for bt in DENSE_BATCHES]
    a, b = fit(xs, ts)
    return {"model": model_name, "train_tflops": 1.0 / b / 1e12, "fixed_us": a * 1e6, "parameters": params,
            "planner_kernels": kernels,
            "times_us": {str(bt): t * 1e6 for bt, t in zip(DENSE_BATCHES, ts)}}


# ---------------------------------------------------------------- the id router (one rank, one thread)

ROUTER_BATCHES = (64, 256, 1024, 2048)


def router(repeats: int, model_name: str = "dlrm_tiny") -> dict[str, float]:
    """neocfg.runtime.routing.IdRouter's host work per step on rank 0 of a 2-rank plan (route this rank's batch,
    receive what both ranks send it), every table table-wise, then half of them row-wise: fit t = a + b x ids
    routed (the ids of the rank's batch), the collectives apart."""
    from neocfg.data.synthetic import SyntheticData
    from neocfg.runtime.layout import build_layout
    from neocfg.runtime.plans import rule_plan
    from neocfg.planner.strategies import id_dtype, routing_encoding
    from neocfg.runtime.routing import ID_DTYPES, IdRouter, deliver
    from neocfg.types import ShardingType
    from common import compose_cfg

    torch.set_num_threads(1)
    model = compose_cfg([f"model={model_name}"]).model
    data = SyntheticData.for_model(model, 0)
    res = {}
    kinds = {"table_wise": ShardingType.table_wise,
             "half_row_wise": {t.name: (ShardingType.row_wise if i % 2 else ShardingType.table_wise)
                               for i, t in enumerate(model.tables)}}
    for name, sharding in kinds.items():
        ids, ts = [], []
        for b in ROUTER_BATCHES:
            plan = rule_plan(model, world=2, devices_per_node=2, batch_size=b, sharding=sharding)
            enc, dt = routing_encoding(plan, model), ID_DTYPES[id_dtype(plan, b)]
            routers = [IdRouter(build_layout(plan, model, r), b, torch.device("cpu"), enc, dt) for r in range(2)]
            batches = [data.batch(r * b, b) for r in range(2)]
            routed = [rt.route(bt) for rt, bt in zip(routers, batches)]
            recv = deliver(routed, routers, 0)

            def step():
                routers[0].route(batches[0])
                routers[0].receive(*recv)

            ts.append(timed(step, repeats))
            ids.append(float(batches[0].values.numel()))
        a, bb = fit(ids, ts)
        res[name] = {"per_step_us": a * 1e6, "per_id_ns": bb * 1e9,
                     "times_us": {str(int(x)): t * 1e6 for x, t in zip(ids, ts)}}
    return res


# ---------------------------------------------------------------- data-parallel replicas' update (one thread)

REPLICA_ROWS = (1_000, 10_000, 50_000)


def replica_update(repeats: int) -> dict[str, float]:
    """neocfg.runtime.replicated's per-step work on a replica that grows with its size, without the all-reduce
    (a 1-rank group): the dense TBE's backward (a dense gradient) and the row-wise Adagrad update over every row;
    fit t = a + b x replica elements (dim 16, 256 samples x 1 id)."""
    from neocfg.batch import Batch
    from neocfg.runtime.replicated import ReplicatedEmbeddings
    from neocfg.types import SparseOptimizer

    torch.set_num_threads(1)
    if not dist.is_initialized():   # the replica's all-reduce on a group of one: no peer, no wire
        store = os.path.join(tempfile.mkdtemp(prefix="calib-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    elems, ts = [], []
    b = 256
    for rows in REPLICA_ROWS:
        rep = ReplicatedEmbeddings([0], [rows], [16], SparseOptimizer.exact_rowwise_adagrad, 0.01, 0,
                                   torch.device("cpu"), None, 1)
        batch = Batch(dense=torch.zeros(b, 1), lengths=torch.ones(1, b, dtype=torch.long),
                      values=torch.randint(0, rows, (b,)), labels=torch.zeros(b), sample_ids=torch.arange(b))

        def step():
            rep(batch).sum().backward()

        ts.append(timed(step, repeats))
        elems.append(float(rows * 16))
    a, bb = fit(elems, ts)
    return {"fixed_us": a * 1e6, "per_element_ns": bb * 1e9, "times_us": {str(int(x)): t * 1e6 for x, t in zip(elems, ts)}}


# ---------------------------------------------------------------- synthetic batches (one thread)

def synthetic(repeats: int) -> dict[str, float]:
    """neocfg.data.synthetic's batch generation per rank and step (what the trainer's prefetch thread does on the
    rank's core): fit t = a + b x samples for dlrm_tiny and criteo_kaggle, and per id across the two."""
    from neocfg.data.synthetic import SyntheticData
    from common import compose_cfg

    torch.set_num_threads(1)
    res = {}
    for name in ("dlrm_tiny", "criteo_kaggle"):
        model = compose_cfg([f"model={name}"]).model
        xs, ts = [], []
        for b in (256, 1024):
            step = [0]

            def make():   # fresh samples every call (no chunk cache hit): a new range each time
                SyntheticData.for_model(model, 0).batch(step[0] * b, b)
                step[0] += 1

            ts.append(timed(make, max(5, repeats // 5)))
            xs.append(float(b))
        a, bb = fit(xs, ts)
        res[name] = {"fixed_us": a * 1e6, "per_sample_us": bb * 1e6,
                     "ids_per_sample": sum(t.pooling_factor for t in model.tables)}
    return res


# ---------------------------------------------------------------- inside a training step (mode=train's ranks)

TRAIN_MODEL = "dlrm_tiny"
TRAIN_BATCHES = (256, 1024)


def _train_rank(env, cfg, plan, steps: int) -> dict[str, float]:
    """One rank of a short mode=train run (neocfg.runtime.train.Trainer, the pipelined step) with the collectives and
    the id router timed per call (wrappers around the calls). The synthetic batches are produced in the step
    instead of the prefetch thread, and timed: on CPU ranks that thread runs on the rank's own core, and would
    slow whatever it overlaps (the planner charges the production as a term of its own, `data_ms`)."""
    import neocfg.data.source as source
    import neocfg.runtime.routing as routing
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import WARMUP_STEPS, Trainer

    source.Prefetcher = lambda inner, pin_memory=False: inner

    calls: dict[str, list[float]] = {"collective": [], "route": [], "receive": [], "finish": []}

    def timed_call(fn, key, skip=lambda *a, **k: False):
        def wrapper(*args, **kwargs):
            if skip(*args, **kwargs):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            calls[key].append(time.perf_counter() - t0)
            return out
        return wrapper

    # synchronous collectives (the counts' and outputs' all-to-alls, gradients', replicas' all-reduce); the ids'
    # payload all-to-all is asynchronous: its wait is finish() less receive()
    dist.all_to_all_single = timed_call(dist.all_to_all_single, "collective", lambda *a, **k: k.get("async_op"))
    routing.IdRouter.route = timed_call(routing.IdRouter.route, "route")
    routing.IdRouter.receive = timed_call(routing.IdRouter.receive, "receive")
    routing.IdRouter.finish = timed_call(routing.IdRouter.finish, "finish")
    trainer = Trainer(cfg, with_strategies(cfg, plan), None, env.device)
    for _ in range(steps):
        trainer.train_step()
        trainer.step += 1
        if trainer.step == WARMUP_STEPS:
            for v in calls.values():
                v.clear()
    n = steps - WARMUP_STEPS
    stats = trainer.source.stats()
    trainer.source.close()
    waits = [f - r for f, r in zip(calls["finish"], calls["receive"])]
    per_call = calls["collective"] + waits
    return {"collective_ms_per_call": sum(per_call) / len(per_call) * 1e3,
            "collective_ms_median": statistics.median(per_call) * 1e3,
            "collectives_per_step": len(per_call) / n,
            "router_ms_per_step": (sum(calls["route"]) + sum(calls["receive"])) / n * 1e3,
            # ids of the rank's batch (what it routes; about what it receives under a balanced plan)
            "ids_per_step": float(sum(t.pooling_factor for t in cfg.model.tables) * cfg.train.batch_size),
            "produce_ms_per_step": stats["data_wait_seconds"] / steps * 1e3}


def train(repeats: int) -> dict[str, object]:
    """mode=train's own step on 2 ranks (TRAIN_MODEL, every table table-wise, the default pipelined step), per
    batch size in TRAIN_BATCHES: the time a rank spends in one collective call (latency, waiting for the peer,
    the gloo threads sharing the rank's core), the id router per step and the synthetic batches' production; fits
    across the batch sizes for the per-id and per-sample rates."""
    from neocfg.runtime.launch import launch
    from neocfg.runtime.plans import rule_plan
    from neocfg.types import ShardingType
    from common import compose_cfg

    steps = max(40, repeats * 2)
    points = {}
    for b in TRAIN_BATCHES:
        cfg = compose_cfg([f"model={TRAIN_MODEL}", "mode=train", f"train.batch_size={b}", f"train.steps={steps}",
                           "train.eval_batches=0"])
        plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=b, sharding=ShardingType.table_wise)
        runs = launch(_train_rank, (cfg, plan, steps), world=2, backend=cfg.hardware.backend, timeout_s=600)
        points[b] = _mean(runs)
    bs = [float(b) for b in TRAIN_BATCHES]
    ids = [points[b]["ids_per_step"] for b in TRAIN_BATCHES]
    r_a, r_b = fit(ids, [points[b]["router_ms_per_step"] for b in TRAIN_BATCHES])
    d_a, d_b = fit(bs, [points[b]["produce_ms_per_step"] for b in TRAIN_BATCHES])
    return {"model": TRAIN_MODEL, "steps": steps, "points": {str(b): p for b, p in points.items()},
            "load_avg_1m": os.getloadavg()[0],
            "collective_ms_per_call": points[TRAIN_BATCHES[0]]["collective_ms_per_call"],
            "router_us_per_step": r_a * 1e3, "router_ns_per_id": r_b * 1e6,
            "synthetic_fixed_us": d_a * 1e3, "synthetic_us_per_sample": d_b * 1e3}


# Data-parallel table sets of TRAIN_MODEL (the rest table-wise): 38 KB and 5.1 MB of fp32 replicas.
DP_SETS = (("t3", "t7"), ("t2", "t4", "t6"))


def _dp_rank(env, cfg, plan, steps: int) -> dict[str, float]:
    """One rank of a short mode=train run: its replicas' all-reduce per step (the comm_dp lap, after warm-up)."""
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import WARMUP_STEPS, Trainer

    trainer = Trainer(cfg, with_strategies(cfg, plan), None, env.device)
    laps = []
    for _ in range(steps):
        _, times = trainer.train_step()
        trainer.step += 1
        laps.append(times.comm_dp)
    trainer.source.close()
    return {"comm_dp_ms": statistics.mean(laps[WARMUP_STEPS:])}


def dp_all_reduce(repeats: int) -> dict[str, object]:
    """The data-parallel tables' gradient all-reduce as mode=train meets it (neocfg/runtime/replicated.py's hook
    inside backward, on a group of its own; the comm_dp lap): TRAIN_MODEL at 256 samples per rank with each of
    DP_SETS data-parallel, fit t = a + b x replica bytes (a: hardware.all_reduce_latency_us)."""
    from neocfg.runtime.launch import launch
    from neocfg.runtime.plans import rule_plan
    from neocfg.types import ShardingType
    from common import compose_cfg

    steps = max(40, repeats * 2)
    cfg = compose_cfg([f"model={TRAIN_MODEL}", "mode=train", "train.batch_size=256", f"train.steps={steps}",
                       "train.eval_batches=0"])
    points = {}
    for dp in DP_SETS:
        plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=256,
                         sharding={t.name: ShardingType.data_parallel if t.name in dp else ShardingType.table_wise
                                   for t in cfg.model.tables})
        nbytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in cfg.model.tables if t.name in dp)
        runs = launch(_dp_rank, (cfg, plan, steps), world=2, backend=cfg.hardware.backend, timeout_s=600)
        points[nbytes] = _mean(runs)["comm_dp_ms"]
    a, b = fit([float(x) for x in points], list(points.values()))
    return {"model": TRAIN_MODEL, "steps": steps, "comm_dp_ms": {str(k): v for k, v in points.items()},
            "load_avg_1m": os.getloadavg()[0], "latency_us": a * 1e3, "ms_per_mb": b * 1e6}


def _concurrent_worker(rank: int, part: str, repeats: int, out: str) -> None:
    res = PARTS[part](repeats)
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def concurrent(part: str, repeats: int, ranks: int) -> dict[str, float]:
    """Run the measurement in `ranks` processes at once, as mode=train's local ranks share the cores; the mean of
    their fits (a rank computes while its peer does: the rates a training step sees)."""
    if ranks <= 1:
        return PARTS[part](repeats)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, part)
        mp.spawn(_concurrent_worker, args=(part, repeats, out), nprocs=ranks, join=True)
        runs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    return _mean(runs)


def _mean(runs: list) -> object:
    """The ranks' mean of every number (nested dicts alike; strings from the first rank)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: _mean([r[k] for r in runs]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(runs) / len(runs)
    return first


# Measurements that run in each of --ranks processes at once (no communication between them).
PARTS = {"tbe": tbe, "dense": dense, "router": router, "replica_update": replica_update, "synthetic": synthetic}


def only(part: str, repeats: int, ranks: int) -> None:
    if part in PARTS:
        res = concurrent(part, repeats, ranks)
    elif part == "step_terms":
        from calibrate_step import fit, measure, run_names
        res = fit(measure(run_names()))
    else:
        res = {"collectives": collectives, "step_collectives": step_collectives, "runtime_dense": runtime_dense,
               "train": train, "dp_all_reduce": dp_all_reduce}[part](repeats)
    print(json.dumps(res, indent=1))


def preset(res: dict) -> dict[str, float]:
    """The cpu_local values from a full run, derived as conf/hardware/cpu_local.yaml's comments say."""
    from neocfg.config.planner import CostConstants
    from common import compose_cfg

    c = compose_cfg(["hardware=cpu_local"])
    consts, hw = CostConstants(), c.hardware
    t, tr, dense = res["tbe"], res["train"], res["runtime_dense"]
    latency_us = tr["collective_ms_per_call"] * 1e3
    peak = res["dense"]["matmul_peak_tflops"]
    per_op = []
    for d in dense.values():   # the fixed cost less DDP's one-bucket all-reduce (latency + 2 x bytes / 2 ranks)
        allreduce_us = latency_us + d["parameters"] * 4 / (hw.intra_node_bandwidth_gbs * 1e3 * consts.comm_efficiency)
        per_op.append((d["fixed_us"] - allreduce_us) / d["planner_kernels"])
    return {
        "collective_latency_us": round(latency_us),
        "all_reduce_latency_us": round(res["dp_all_reduce"]["latency_us"]),
        "intra_node_bandwidth_gbs": round(res["collectives"]["all_to_all"]["gbs"], 3),
        "device.hbm_bandwidth_gbs": round(t["hbm_bandwidth_gbs_for_preset"], 2),
        "device.peak_tflops": round(peak, 3),
        "device.dense_mfu": round(dense["criteo_kaggle"]["train_tflops"] / peak, 2),
        "device.kernel_overhead_us": round(statistics.mean(per_op)),
        "device.routing_us_per_step": round(tr["router_us_per_step"]),
        "device.tbe_us_per_group": round(t["call_overhead_us_fwd_bwd"]),
        "device.routing_ns_per_id": round(tr["router_ns_per_id"], 1),
        "device.stream_bandwidth_gbs": round(consts.replica_update_passes * 4 / res["replica_update"]["per_element_ns"], 1),
        "host.synthetic_us_per_batch": round(tr["synthetic_fixed_us"]),
        "host.synthetic_ns_per_id": round(_per_id_ns(res["synthetic"]), 1),
        "host.synthetic_us_per_sample": round(tr["synthetic_us_per_sample"] - res["synthetic"][TRAIN_MODEL][
            "ids_per_sample"] * _per_id_ns(res["synthetic"]) / 1e3, 2),
    }


def _per_id_ns(syn: dict) -> float:
    """Generation time per id: the per-sample difference of the two models over their ids per sample."""
    a, b = syn["dlrm_tiny"], syn["criteo_kaggle"]
    return (b["per_sample_us"] - a["per_sample_us"]) / (b["ids_per_sample"] - a["ids_per_sample"]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    ap.add_argument("--only", choices=["collectives", "step_collectives", "runtime_dense", "train", "dp_all_reduce",
                                       "step_terms", *PARTS])
    ap.add_argument("--ranks", type=int, default=2, help="processes measuring the single-rank parts at once (mode=train's)")
    a = ap.parse_args()
    if a.only:
        return only(a.only, a.repeats, a.ranks)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
           "load_avg_1m": os.getloadavg()[0], "ranks": a.ranks, "collectives": collectives(a.repeats),
           "step_collectives": step_collectives(a.repeats), "runtime_dense": runtime_dense(a.repeats),
           "train": train(a.repeats), "dp_all_reduce": dp_all_reduce(a.repeats), **{part: concurrent(part, a.repeats, a.ranks) for part in PARTS}}
    from calibrate_step import fit as fit_steps, measure as measure_steps, run_names
    res["step_terms"] = fit_steps(measure_steps(run_names()))
    # the embedding compute, dense and data constants from whole training steps (they supersede the parts alone)
    res["preset"] = preset(res) | {k: v for k, v in res["step_terms"]["preset"].items() if k != "dense_tflops"} | {
        "device.dense_mfu": round(res["step_terms"]["preset"]["dense_tflops"] / res["dense"]["matmul_peak_tflops"], 2)}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
