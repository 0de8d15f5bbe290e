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
Kaggle tables capped at 1M rows, dim 16, MLPs 512-256-64-16 / 512-256-1).

TorchRec lives in .venv-torchrec (`make torchrec-env`: TorchRec 1.8 without its CUDA dependencies, beside
fbgemm-gpu-cpu 1.8). Run from either environment: without TorchRec importable here, the bench builds that
environment if needed and re-runs itself there, or says why it cannot.

    .venv/bin/python bench/bench_vs_torchrec.py [--models tiny8,criteo] [--steps 40] [--repeats 3] [--out x.json]
        [--variant NAME:OVERRIDES ...] [--no-own-plan]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cap_rows, compose_cfg, emit  # noqa: E402

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


def neocfg_config(model: str, batch: int, steps: int, sharding_types: str | None, extra: tuple[str, ...] = ()):
    common = ["hardware=cpu_local", "mode=train", f"train.steps={steps}", f"train.batch_size={batch}",
              "train.eval_batches=0", f"train.log_every={steps}", "train.dense_optimizer=adagrad",
              f"train.dense_learning_rate={LR}", "train.sparse_optimizer=exact_rowwise_adagrad",
              f"train.sparse_learning_rate={LR}"]
    if sharding_types:
        common.append(f"planner.sharding_types=[{sharding_types}]")
    common += list(extra)
    if model == "tiny8":
        cfg = compose_cfg(["model=dlrm_tiny", *common])
        tables = [dataclasses.replace(t, num_embeddings=r, pooling_factor=float(p))
                  for t, r, p in zip(cfg.model.tables, TINY8_ROWS, TINY8_POOLING)]
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="tiny8", tables=tables))
    if model == "criteo":
        return compose_cfg(["model=criteo_kaggle", *cap_rows("criteo_kaggle", 1_000_000), *common])
    raise SystemExit(f"--models: unknown model {model!r}; allowed: tiny8, criteo")


def bench_batches(cfg, rank: int) -> list:
    """This rank's BENCH_BATCHES synthetic batches (the samples its neocfg source would deliver first)."""
    from neocfg.data.synthetic import SyntheticData

    data, b = SyntheticData.for_model(cfg.model, cfg.dsi.seed), cfg.train.batch_size
    return [data.batch((s * WORLD + rank) * b, b) for s in range(BENCH_BATCHES)]


class CycleSource:
    """neocfg's BatchSource over pre-generated batches, in a cycle."""

    def __init__(self, batches: list) -> None:
        self.batches, self.step = batches, 0

    def next_batch(self):
        batch = self.batches[self.step % len(self.batches)]
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ TorchRec side


def _build_dmp(cfg, exported: dict, rank: int):
    """TorchRec's DLRM of the same model under DMP with the given placement; its dense optimizer; its batches."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from neocfg.interop.torchrec import to_sharding_plan

    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                           feature_names=[t.name]) for t in m.tables], device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=m.num_dense_features,
                 dense_arch_layer_sizes=list(m.bottom_layers), over_arch_layer_sizes=list(m.top_mlp))
    sharders = [EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                            "learning_rate": LR})]
    plan = to_sharding_plan(exported, {t.name: "sparse_arch.embedding_bag_collection" for t in m.tables})
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, device=torch.device("cpu"))
    opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                lambda ps: torch.optim.Adagrad(ps, lr=LR))
    keys = [t.name for t in m.tables]
    batches = []
    for x in bench_batches(cfg, rank):
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
                trainer = Trainer(cfg, plan, None, torch.device("cpu"), source=CycleSource(bench_batches(cfg, rank)))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny8,criteo")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40, help="steps per system per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-own-plan", action="store_true", help="skip neocfg on its own (unforced) plan")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                    help="neocfg on the table-wise plan with extra space-separated Hydra overrides (repeatable)")
    ap.add_argument("--out")
    a = ap.parse_args()
    ensure_torchrec()
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
