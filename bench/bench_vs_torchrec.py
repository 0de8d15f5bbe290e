"""Neocfg vs TorchRec 1.8's DistributedModelParallel on the same model, ranks, batch and table-wise placement:
samples/s of each, interleaved step by step, and their ratio; also neocfg on its own plan.

Both train on 2 gloo ranks, one thread per rank, batch 512 per rank, every table table-wise on the same rank (the
placement neocfg's planner picks under planner.sharding_types=[table_wise], handed to DMP through
neocfg.interop's torchrec_plan converter), fused exact row-wise Adagrad on the tables and Adagrad on the dense part
(lr 0.05 both). The same 2 rank processes hold all three (neocfg's Trainer on the table-wise plan, on its own plan,
and DMP) and take turns one step each, the order rotating, after a barrier, so the machine's load (shared, noisy)
hits all alike; each step's time on rank 0 counts, the medians over steps give samples/s, and repeats (fresh
processes) give the spread. Both cycle through the same 8 synthetic batches per rank, generated before timing
(neocfg's Trainer gets them as its batch source, TorchRec as KeyedJaggedTensors), so neither pays for batch
generation in its timed steps (neocfg's own prefetch thread would otherwise compete with the two ranks for the two
cores while either system runs). What is timed: neocfg's Trainer.train_step (input distribution, lookups, output
exchange, dense forward/backward with DDP, both optimizers), TorchRec's DMP forward, loss, backward and optimizer
step. Both skip 2 warm-up steps.

--variant NAME:OVERRIDES adds neocfg on the table-wise plan with extra Hydra overrides (space-separated) to the same
interleaving, e.g. --variant "nopipe:train.pipeline=false"; its ratio to TorchRec is printed too.

Models: `tiny8` (8 tables of dim 16, 1k..200k rows, pooling 1..4, dlrm_tiny's MLPs) and `criteo` (the Criteo
Kaggle tables capped at 1M rows, dim 16, MLPs 512-256-64-16 / 512-256-1); any other model as PRESET@ROWS[:dim=D]: a
conf/model preset with every table capped at ROWS rows and, with dim=D, every table's dim and the bottom MLP's last
layer D (TorchRec's DLRM and DLRM_DCN need one dim, the bottom MLP's last), e.g. `criteo_tb_mlperf_v1@100000:dim=32`
(a shape neither system was tuned on).

--whole-run: the comparison a user makes, each system as its own processes: `neocfg mode=train` (a subprocess,
spawning its 2 ranks) on the same plan, once with dsi.cycle_batches=8 (the same cycled batches) and once on its
default learnable stream (batches generated in its prefetch thread beside the step), against a TorchRec DMP run in
its own 2 spawned processes cycling the same 8 batches per rank. Models x --ids (uniform: every zipf_alpha 0; zipf:
the presets' skew) x --sharding (table_wise, row_wise: TorchRec's EBC sharder with CPU row-wise,
CpuRowWiseEmbeddingBagCollectionSharder). Runs interleave A/B/C, C/A/B, ...; the best of --repeats (2) counts;
samples/s of the steps after the first 2 (neocfg's metrics.json; the same window in TorchRec's loop). --results
writes the table into bench/RESULTS.md; --record-from X.json ... writes it from the --out files of several
invocations (e.g. one case per invocation, each short enough for the CPU lock), in the order given.

TorchRec lives in .venv-torchrec (`make torchrec-env`: TorchRec 1.8 without its CUDA dependencies, beside
fbgemm-gpu-cpu 1.8). Run from either environment: without TorchRec importable here, the bench builds that
environment if needed and re-runs itself there, or says why it cannot.

    .venv/bin/python bench/bench_vs_torchrec.py [--models tiny8,criteo] [--steps 40] [--repeats 3] [--out x.json]
        [--variant NAME:OVERRIDES ...] [--no-own-plan]
    .venv-torchrec/bin/python bench/bench_vs_torchrec.py --whole-run [--models tiny8,criteo] [--ids uniform,zipf]
        [--sharding table_wise,row_wise] [--whole-steps 80] [--repeats 2] [--results] [--out x.json]
    .venv-torchrec/bin/python bench/bench_vs_torchrec.py --whole-run --record-from a.json b.json ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cap_rows, compose_cfg, emit, record_results  # noqa: E402

WORLD = 2
LR = 0.05
WARMUP = 2
# Fresh ports to try when the one picked is taken before rank 0 binds it (other jobs share the machine).
PORT_ATTEMPTS = 3
# Distinct pre-generated batches both systems cycle through (generation stays out of the timing).
BENCH_BATCHES = 8
# tiny8: rows and pooling per table (dlrm_tiny's tables resized to span 1k..200k rows and pooling 1..4).
TINY8_ROWS = (1000, 5000, 20000, 200000, 10000, 2000, 50000, 100000)
TINY8_POOLING = (1, 2, 1, 3, 1, 4, 1, 2)
ID_KINDS = ("uniform", "zipf")


def ensure_torchrec() -> None:
    """Re-run this script under .venv-torchrec when TorchRec is not importable here (building it if needed)."""
    try:
        import torchrec  # noqa: F401
        return
    except ImportError:
        pass
    tr_py = REPO / ".venv-torchrec" / "bin" / "python"
    if not tr_py.exists():
        print("TorchRec is not installed here; building .venv-torchrec (make torchrec-env) ...", file=sys.stderr)
        r = subprocess.run(["make", "-C", str(REPO), "torchrec-env"], capture_output=True, text=True)
        if r.returncode != 0 or not tr_py.exists():
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            sys.exit("bench_vs_torchrec: cannot set up TorchRec (make torchrec-env failed): " + " | ".join(tail))
    if os.environ.get("NEOCFG_BENCH_REEXEC"):
        sys.exit(f"bench_vs_torchrec: TorchRec does not import in {tr_py}; rebuild it: make clean torchrec-env")
    os.environ["NEOCFG_BENCH_REEXEC"] = "1"
    os.execv(str(tr_py), [str(tr_py), *sys.argv])


def model_overrides(model: str, ids: str = "zipf") -> list[str]:
    """The Hydra overrides that make `model` (tiny8, criteo) with `ids` (zipf: the preset's skew; uniform: every
    table's zipf_alpha 0), as a user passes them to `neocfg`."""
    if model == "tiny8":
        out = ["model=dlrm_tiny", "model.name=tiny8"]
        for i, (r, p) in enumerate(zip(TINY8_ROWS, TINY8_POOLING)):
            out += [f"model.tables.{i}.num_embeddings={r}", f"model.tables.{i}.pooling_factor={p}"]
        n_tables = len(TINY8_ROWS)
    elif model == "criteo":
        out = ["model=criteo_kaggle", *cap_rows("criteo_kaggle", 1_000_000)]
        n_tables = len(compose_cfg(["model=criteo_kaggle"]).model.tables)
    elif "@" in model:
        out, n_tables = preset_overrides(model)
    else:
        raise SystemExit(f"--models: unknown model {model!r}; allowed: tiny8, criteo, PRESET@ROWS[:dim=D]")
    if ids not in ID_KINDS:
        raise SystemExit(f"--ids: unknown id distribution {ids!r}; allowed: {', '.join(ID_KINDS)}")
    if ids == "uniform":
        out += [f"model.tables.{i}.zipf_alpha=0" for i in range(n_tables)]
    return out


def preset_overrides(spec: str) -> tuple[list[str], int]:
    """PRESET@ROWS[:dim=D] (see the module's doc) as overrides, and the preset's number of tables."""
    name, _, rest = spec.partition("@")
    rows, *opts = rest.split(":")
    presets = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    if name not in presets:
        raise SystemExit(f"--models: unknown preset {name!r} in {spec!r}; allowed: {', '.join(presets)}")
    if not rows.isdigit() or int(rows) < 1:
        raise SystemExit(f"--models: {spec!r}: the row cap {rows!r} must be a positive integer")
    cfg = compose_cfg([f"model={name}"])
    out = [f"model={name}", f"model.name={name}_{rows}", *cap_rows(name, int(rows))]
    for opt in opts:
        key, _, value = opt.partition("=")
        if key != "dim" or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--models: {spec!r}: unknown option {opt!r}; allowed: dim=D (a positive integer)")
        out += [f"model.tables.{i}.embedding_dim={value}" for i in range(len(cfg.model.tables))]
        out.append(f"model.bottom_mlp=[{','.join(map(str, [*cfg.model.bottom_layers[:-1], int(value)]))}]")
    return out, len(cfg.model.tables)


def train_overrides(batch: int, steps: int, sharding_types: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    out = ["hardware=cpu_local", "mode=train", f"train.steps={steps}", f"train.batch_size={batch}",
           "train.eval_batches=0", f"train.log_every={steps}", "train.dense_optimizer=adagrad",
           f"train.dense_learning_rate={LR}", "train.sparse_optimizer=exact_rowwise_adagrad",
           f"train.sparse_learning_rate={LR}",
           "train.divergence_factor=0"]   # a speed run: criteo_kaggle's loss spikes at this rate (both systems' rate)
    if sharding_types:
        out.append(f"planner.sharding_types=[{sharding_types}]")
    return out + list(extra)


def neocfg_config(model: str, batch: int, steps: int, sharding_types: str | None, extra: tuple[str, ...] = (),
                  ids: str = "zipf"):
    return compose_cfg([*model_overrides(model, ids), *train_overrides(batch, steps, sharding_types, extra)])


def bench_source(cfg, rank: int):
    """This rank's BENCH_BATCHES synthetic batches, generated once and cycled (what dsi.cycle_batches=8 gives
    `neocfg mode=train`)."""
    from neocfg.data.source import SyntheticSource
    from neocfg.data.synthetic import SyntheticData

    return SyntheticSource(SyntheticData.for_model(cfg.model, cfg.dsi.seed), rank, WORLD, cfg.train.batch_size,
                           cycle=BENCH_BATCHES)


# ------------------------------------------------------------------------------------------------ TorchRec side


def _build_dmp(cfg, exported: dict, rank: int):
    """TorchRec's DLRM of the same model under DMP with the given placement; its dense optimizer; its batches."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from neocfg.interop.torchrec import CpuRowWiseEmbeddingBagCollectionSharder, to_sharding_plan

    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                           feature_names=[t.name]) for t in m.tables], device=torch.device("meta"))
    arch = dict(embedding_bag_collection=ebc, dense_in_features=m.num_dense_features,
                dense_arch_layer_sizes=list(m.bottom_layers), over_arch_layer_sizes=list(m.top_mlp))
    dcn = m.interaction.value == "dcn"
    model = (DLRM_DCN(**arch, dcn_num_layers=m.dcn_num_layers, dcn_low_rank_dim=m.dcn_low_rank_dim) if dcn
             else DLRM(**arch))
    sharders = [CpuRowWiseEmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR})]   # TorchRec's EBC sharder + CPU RW
    plan = to_sharding_plan(exported, {t.name: "sparse_arch.embedding_bag_collection" for t in m.tables})
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, device=torch.device("cpu"))
    opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                lambda ps: torch.optim.Adagrad(ps, lr=LR))
    keys = [t.name for t in m.tables]
    batches = []
    for x in bench_source(cfg, rank).cycled:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=x.values, lengths=x.lengths.reshape(-1))
        batches.append((x.dense, kjt, x.labels))
    counter = [0]

    def step() -> None:
        dense, kjt, labels = batches[counter[0] % BENCH_BATCHES]
        counter[0] += 1
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(-1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _worker(rank: int, port: int, jobs: dict, steps: int, out_dir: str) -> None:
    """jobs: name -> (kind, cfg, plan); every system takes one step in turn (rotating order) after a barrier."""
    import torch
    import torch.distributed as dist

    from neocfg.interop.export import to_torchrec_dict
    from neocfg.planner.strategies import with_strategies
    from neocfg.runtime.train import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        step_fns = {}
        for name, (kind, cfg, plan) in jobs.items():
            if kind == "torchrec":
                step_fns[name] = _build_dmp(cfg, to_torchrec_dict(plan, "cpu"), rank)
            else:
                trainer = Trainer(cfg, with_strategies(cfg, plan, source_prefetches=False), None, torch.device("cpu"),
                                  source=bench_source(cfg, rank))
                step_fns[name] = lambda t=trainer: t.train_step()
        names = list(step_fns)
        times = {n: [] for n in names}
        terms: dict[str, list] = {n: [] for n in names}   # neocfg's own per-category times (StepTimes)
        for s in range(steps):
            order = names[s % len(names):] + names[:s % len(names)]
            for n in order:
                dist.barrier()
                t0 = time.perf_counter()
                got = step_fns[n]()
                if s >= WARMUP:
                    times[n].append(time.perf_counter() - t0)
                    if got is not None:
                        terms[n].append(dataclasses.asdict(got[1]))
        if rank == 0:
            b = next(iter(jobs.values()))[1].train.batch_size
            Path(out_dir, "steps.json").write_text(json.dumps(
                {n: {"step_ms": statistics.median(v) * 1e3, "samples_per_s": WORLD * b / statistics.median(v),
                     "terms_median_ms": {k: statistics.median(t[k] for t in terms[n]) for k in terms[n][0]}
                     if terms[n] else None} for n, v in times.items()}))
    finally:
        dist.destroy_process_group()



def run_interleaved(jobs: dict, steps: int) -> dict:
    import torch.multiprocessing as mp

    from neocfg.runtime.launch import free_port

    for attempt in range(PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory() as out:
            try:
                mp.start_processes(_worker, args=(free_port(), jobs, steps, out), nprocs=WORLD, start_method="spawn")
            except mp.ProcessRaisedException as exc:   # another job took the free port before rank 0 bound it
                if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
                continue
            return json.loads(Path(out, "steps.json").read_text())
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------------ whole runs


def _torchrec_rank(rank: int, port: int, spec: dict, out_dir: str) -> None:
    """One rank of a TorchRec DMP run as a user writes it: its own process, the plan's placement, cycled batches;
    samples/s from the steps after WARMUP (as neocfg's metrics.json counts them)."""
    import torch
    import torch.distributed as dist

    from neocfg.interop.export import to_torchrec_dict
    from neocfg.plan import Plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))   # the threads neocfg gives each rank
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = compose_cfg(spec["overrides"])
        step = _build_dmp(cfg, to_torchrec_dict(Plan.load(Path(spec["plan"])), "cpu"), rank)
        t0 = time.perf_counter()
        for s in range(spec["steps"]):
            if s == WARMUP:
                t0 = time.perf_counter()
            step()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            timed = spec["steps"] - WARMUP
            Path(out_dir, "torchrec.json").write_text(json.dumps({
                "samples_per_s": WORLD * cfg.train.batch_size * timed / elapsed, "step_ms": elapsed * 1e3 / timed}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def torchrec_run(spec_file: str) -> None:
    """--torchrec-run SPEC: this process starts the WORLD TorchRec ranks and writes their result next to SPEC."""
    import torch.multiprocessing as mp

    from neocfg.runtime.launch import free_port

    spec = json.loads(Path(spec_file).read_text())
    out = str(Path(spec_file).parent)
    for attempt in range(PORT_ATTEMPTS):
        try:
            mp.start_processes(_torchrec_rank, args=(free_port(), spec, out), nprocs=WORLD, start_method="spawn")
            return
        except mp.ProcessRaisedException as exc:   # another job took the free port before rank 0 bound it
            if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                raise


def _timed_process(cmd: list[str], result: Path) -> dict:
    """Run one whole run; its samples/s (from `result`) and the process's wall time."""
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NEOCFG_BENCH_REEXEC": "1"})
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not result.exists():
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-4:])
        raise SystemExit(f"bench_vs_torchrec: whole run failed (exit {r.returncode}): {' '.join(cmd[:4])} ...: {tail}")
    got = json.loads(result.read_text())
    return {"samples_per_s": got["samples_per_s"], "wall_s": wall,
            "breakdown_ms": got.get("breakdown_ms"), "measured_step_ms": got.get("measured_step_ms", got.get("step_ms"))}


def whole_run_case(model: str, ids: str, sharding: str, a, tmp: Path) -> dict:
    """neocfg mode=train (cycled batches and its default stream) and TorchRec DMP (cycled batches), each as its own
    processes on the same plan, interleaved A/B/C, A/B/C..., best of a.repeats."""
    from neocfg.contract import load_or_make_plan

    case = tmp / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}_{ids}_{sharding}")   # a path Hydra overrides can hold
    case.mkdir()
    overrides = [*model_overrides(model, ids), *train_overrides(a.batch, a.whole_steps, sharding)]
    plan_file = case / "plan.json"
    load_or_make_plan(compose_cfg(overrides)).save(plan_file)
    neocfg = [sys.executable, "-m", "neocfg", *overrides, f"planner.plan_file={plan_file}"]
    spec = case / "torchrec_spec.json"
    spec.write_text(json.dumps({"overrides": overrides, "plan": str(plan_file), "steps": a.whole_steps}))
    systems = {
        "neocfg_cycled": ([*neocfg, f"dsi.cycle_batches={BENCH_BATCHES}", f"hydra.run.dir={case / 'cycled'}"],
                          case / "cycled" / "metrics.json"),
        "neocfg_stream": ([*neocfg, f"hydra.run.dir={case / 'stream'}"], case / "stream" / "metrics.json"),
        "torchrec": ([sys.executable, str(Path(__file__).resolve()), "--torchrec-run", str(spec)],
                     case / "torchrec.json")}
    names = list(systems)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(a.repeats):
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            runs[n].append(_timed_process(*systems[n]))
        print(f"{model} {ids} {sharding} repeat {rep + 1}/{a.repeats}: "
              + ", ".join(f"{n} {runs[n][-1]['samples_per_s']:,.0f}" for n in names) + " samples/s", file=sys.stderr)
    best = {n: max(r["samples_per_s"] for r in v) for n, v in runs.items()}
    return {"model": model, "ids": ids, "sharding": sharding, "best_samples_per_s": best,
            "ratio_cycled": best["neocfg_cycled"] / best["torchrec"],
            "ratio_stream": best["neocfg_stream"] / best["torchrec"], "runs": runs}


# Whole-run targets: neocfg / TorchRec DMP samples/s, table-wise and row-wise.
TARGET_TW, TARGET_RW = 1.3, 1.0
WHOLE_RUN_SECTION = "Whole runs against TorchRec"


def _steps_text(cases: list[dict]) -> str:
    """The runs' steps, e.g. `500` or `tiny8 1,000, criteo table_wise 500, criteo row_wise 200`."""
    if len({c["steps"] for c in cases}) == 1:
        return f"{cases[0]['steps']:,}"
    by_model: dict[str, dict[str, int]] = {}
    for c in cases:
        by_model.setdefault(c["model"], {})[c["sharding"]] = c["steps"]
    return ", ".join(f"{m} {next(iter(s.values())):,}" if len(set(s.values())) == 1
                     else ", ".join(f"{m} {k} {n:,}" for k, n in s.items()) for m, s in by_model.items())


def whole_run_markdown(cases: list[dict], repeats: int) -> str:
    """The summary table (best of the repeats per system) and every run's samples/s; each case carries its steps."""
    rows = ["| model | ids | sharding | neocfg cycled | neocfg stream | TorchRec DMP | cycled / TorchRec | "
            "stream / TorchRec | target |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in cases:
        b = c["best_samples_per_s"]
        target = TARGET_TW if c["sharding"] == "table_wise" else TARGET_RW
        rows.append(f"| {c['model']} | {c['ids']} | {c['sharding']} | {b['neocfg_cycled']:,.0f} | "
                    f"{b['neocfg_stream']:,.0f} | {b['torchrec']:,.0f} | {c['ratio_cycled']:.2f}x | "
                    f"{c['ratio_stream']:.2f}x | >= {target}x |")
    runs = ["| model | ids | sharding | neocfg cycled, each run | neocfg stream, each run | TorchRec DMP, each run |",
            "|---|---|---|---|---|---|"]
    for c in cases:
        each = [", ".join(f"{r['samples_per_s']:,.0f}" for r in c["runs"][n])
                for n in ("neocfg_cycled", "neocfg_stream", "torchrec")]
        runs.append(f"| {c['model']} | {c['ids']} | {c['sharding']} | {' | '.join(each)} |")
    return "\n".join([
        f"Each system as its own processes, as a user runs it: `neocfg mode=train` ({WORLD} gloo ranks) with "
        f"`dsi.cycle_batches={BENCH_BATCHES}` (cycled) and with its default learnable stream (stream), and TorchRec "
        f"DMP in its own {WORLD} processes cycling the same {BENCH_BATCHES} pre-generated batches per rank; same plan "
        f"(every table of a row in its sharding type; TorchRec's EBC sharder, with row-wise on CPU), batch "
        f"{cases[0]['batch_per_rank']} per rank, fused exact row-wise Adagrad, {_steps_text(cases)} steps per run of "
        f"which the first {WARMUP} are not timed; interleaved, best of {repeats}; samples/s of the timed steps.", "",
        *rows, "", "Every run (the machine is shared: single runs spread; the table above takes each system's best):",
        "", *runs])


def whole_run(a) -> None:
    cases = []
    with tempfile.TemporaryDirectory() as tmpdir:
        for model in a.models.split(","):
            for ids in a.ids.split(","):
                for sharding in a.sharding.split(","):
                    c = whole_run_case(model, ids, sharding, a, Path(tmpdir))
                    c |= {"steps": a.whole_steps, "batch_per_rank": a.batch}
                    target = TARGET_TW if sharding == "table_wise" else TARGET_RW
                    print(f"{model} {ids} {sharding}: neocfg (cycled) / TorchRec DMP {c['ratio_cycled']:.2f}x, "
                          f"neocfg (stream) / TorchRec {c['ratio_stream']:.2f}x (target >= {target}x)",
                          file=sys.stderr)
                    cases.append(c)
    if a.results:
        record_results(WHOLE_RUN_SECTION, whole_run_markdown(cases, a.repeats))
    emit({"bench": "neocfg_vs_torchrec_whole_runs", "world": WORLD, "batch_per_rank": a.batch,
          "steps": a.whole_steps, "repeats": a.repeats, "cycled_batches": BENCH_BATCHES, "cases": cases}, a.out)


def record_whole_runs(files: list[str], note: str = "", section: str = WHOLE_RUN_SECTION) -> None:
    """--record-from: the whole-run table from the --out files of several invocations, cases in the order given;
    note: a paragraph said before the tables (e.g. how loaded the machine was); section: RESULTS.md's section (e.g.
    one of its own for models neither system was tuned on)."""
    cases, repeats = [], set()
    for f in files:
        got = json.loads(Path(f).read_text())
        if got.get("bench") != "neocfg_vs_torchrec_whole_runs":
            raise SystemExit(f"bench_vs_torchrec: --record-from {f}: not a --whole-run --out file")
        repeats.add(got["repeats"])
        cases += [{"steps": got["steps"], "batch_per_rank": got["batch_per_rank"], **c} for c in got["cases"]]
    if len(repeats) != 1:
        raise SystemExit(f"bench_vs_torchrec: --record-from: the files ran different --repeats ({sorted(repeats)})")
    how = (f"Each file is one invocation (`--whole-run --models M --ids I --sharding S --whole-steps N --out FILE`, "
           f"one case each, under the CPU lock), recorded together by `--record-from`.\n\n")
    record_results(section, how + (f"{note}\n\n" if note else "") + whole_run_markdown(cases, repeats.pop()))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--torchrec-run":
        ensure_torchrec()
        return torchrec_run(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny8,criteo")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40, help="steps per system per repeat (in-process mode)")
    ap.add_argument("--repeats", type=int, help="fresh runs of every system (default 3; whole runs: best of 2)")
    ap.add_argument("--no-own-plan", action="store_true", help="skip neocfg on its own (unforced) plan")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                    help="neocfg on the table-wise plan with extra space-separated Hydra overrides (repeatable)")
    ap.add_argument("--whole-run", action="store_true",
                    help="each system as its own processes (neocfg mode=train vs TorchRec DMP), see the docstring")
    ap.add_argument("--ids", default="uniform,zipf", help="whole runs: id distributions")
    ap.add_argument("--sharding", default="table_wise,row_wise", help="whole runs: sharding types")
    ap.add_argument("--whole-steps", type=int, default=80, help="whole runs: steps per run")
    ap.add_argument("--results", action="store_true", help="whole runs: write the table into bench/RESULTS.md")
    ap.add_argument("--record-from", nargs="+", metavar="JSON",
                    help="whole runs: write the table into bench/RESULTS.md from these --out files")
    ap.add_argument("--note", default="", help="with --record-from: a paragraph said before the tables")
    ap.add_argument("--section", default=WHOLE_RUN_SECTION, help="with --record-from: the RESULTS.md section")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.record_from:
        return record_whole_runs(a.record_from, a.note, a.section)
    ensure_torchrec()
    if a.whole_run:
        a.repeats = a.repeats or 2
        return whole_run(a)
    a.repeats = a.repeats or 3
    from neocfg.contract import load_or_make_plan

    results = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for model in a.models.split(","):
            tw_cfg = neocfg_config(model, a.batch, a.steps, "table_wise")
            tw_plan = load_or_make_plan(tw_cfg)
            own_cfg = neocfg_config(model, a.batch, a.steps, None)
            own_plan = load_or_make_plan(own_cfg)
            jobs = {"neocfg_tw": ("neocfg", tw_cfg, tw_plan), "torchrec_tw": ("torchrec", tw_cfg, tw_plan)}
            if not a.no_own_plan:
                jobs["neocfg_own"] = ("neocfg", own_cfg, own_plan)
            for spec in a.variant:
                name, _, overrides = spec.partition(":")
                jobs[f"neocfg_{name}"] = ("neocfg", neocfg_config(model, a.batch, a.steps, "table_wise",
                                                                tuple(overrides.split())), tw_plan)
            runs: dict[str, list[dict]] = {k: [] for k in jobs}
            for rep in range(a.repeats):
                got = run_interleaved(jobs, a.steps)
                for k in jobs:
                    runs[k].append(got[k])
                line = ", ".join(f"{k} {v[-1]['samples_per_s']:,.0f}" for k, v in runs.items())
                print(f"{model} repeat {rep + 1}/{a.repeats}: samples/s {line}", file=sys.stderr)
            med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items() if v}
            per_rep = [n["samples_per_s"] / t["samples_per_s"] for n, t in zip(runs["neocfg_tw"], runs["torchrec_tw"])]
            per_own = [n["samples_per_s"] / t["samples_per_s"] for n, t in zip(runs.get("neocfg_own", []),
                                                                                 runs["torchrec_tw"])]
            results[model] = {
                "median_samples_per_s": med,
                "ratio_tw": statistics.median(per_rep),
                "ratio_tw_per_repeat": per_rep,
                "ratio_own_plan": statistics.median(per_own) if per_own else None,
                "ratio_own_plan_per_repeat": per_own,
                "own_plan_shardings": sorted({t.sharding.value for t in own_plan.tables}),
                "runs": runs}
            for spec in a.variant:
                k = f"neocfg_{spec.partition(':')[0]}"
                per = [n["samples_per_s"] / t["samples_per_s"] for n, t in zip(runs[k], runs["torchrec_tw"])]
                results[model][f"ratio_{k}_per_repeat"] = per
                print(f"{model}: {k} / TorchRec DMP: {statistics.median(per):.2f}x (per repeat "
                      + ", ".join(f"{r:.2f}" for r in per) + ")", file=sys.stderr)
            own = results[model]["ratio_own_plan"]
            print(f"{model}: neocfg / TorchRec DMP samples/s (table-wise, median of {a.repeats} repeats): "
                  f"{results[model]['ratio_tw']:.2f}x (target >= 1.2x; per repeat "
                  + ", ".join(f"{r:.2f}" for r in per_rep) + ")"
                  + (f"; neocfg's own plan {own:.2f}x" if own else ""), file=sys.stderr)
    emit({"bench": "neocfg_vs_torchrec_dmp", "world": WORLD, "batch_per_rank": a.batch, "steps": a.steps,
          "repeats": a.repeats, "results": results}, a.out)


if __name__ == "__main__":
    main()
