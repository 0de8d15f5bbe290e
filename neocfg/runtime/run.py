"""mode=train's runtime: start the ranks on the plan it is given (neocfg.contract plans, loads or rates it), train,
evaluate, write metrics.json. Nothing here plans or prices: the plan says what runs and what it should cost."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Optional

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import CheckpointError, ConfigError, NeocfgError
from neocfg.plan import Plan
from neocfg.run_metrics import METRICS_FILE, RunMetrics, render
from neocfg.runtime.checkpoint import Checkpointer, locked
from neocfg.runtime.layout import build_layout
from neocfg.runtime.launch import RankEnv, check_single_host, keep_freed_memory, launch, under_torchrun
from neocfg.types import Backend


# Makes the run's plan (neocfg.contract.load_or_make_plan): a validated Plan with its predicted terms.
PlanMaker = Callable[[NeocfgConfig], Plan]


def checkpoint_root(cfg: NeocfgConfig, run_dir: Optional[Path]) -> Optional[Path]:
    """Where this run's checkpoints go (None: it writes none and resumes from none)."""
    tc = cfg.train
    if tc.checkpoint_dir:
        return Path(tc.checkpoint_dir)
    return run_dir / "checkpoints" if run_dir is not None and tc.checkpoint_every else None


def _rank_main(env: RankEnv, cfg: NeocfgConfig, plan: Optional[Plan], run_dir: Optional[Path],
               make_plan: Optional[PlanMaker] = None) -> Any:
    from neocfg.runtime.train import train_rank

    keep_freed_memory()
    if plan is None:  # under torchrun every process runs the CLI: rank 0 plans, the others take its plan
        import torch.distributed as dist

        assert make_plan is not None, "under torchrun rank 0 makes the plan"
        box = [make_plan(cfg).to_dict() if env.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_dict(box[0])
        if env.rank == 0 and run_dir is not None:
            plan.save(run_dir / "plan.json")

    result = train_rank(cfg, plan, run_dir, env.device)
    return result.metrics if env.rank == 0 else None


def check_trainable(cfg: NeocfgConfig) -> None:
    if cfg.model.planning_only:
        raise ConfigError("model", cfg.model.name, "is a planning-only model (too big to instantiate here); "
                          "mode=train needs one that fits, e.g. model=dlrm_tiny")
    hw = cfg.hardware
    check_single_host(hw)
    if hw.backend is Backend.nccl and not under_torchrun():
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < hw.devices_per_node:
            raise ConfigError("hardware", hw.name,
                              f"needs {hw.devices_per_node} CUDA devices per node (nccl), this machine has {have}; "
                              f"train on CPU with hardware=cpu_local, or start the ranks with torchrun")


def resume_advice(cfg: NeocfgConfig, root: Path, path: Path, ckpt: Checkpointer) -> str:
    """What to do about a checkpoint written for another plan, checked: its plan.json is suggested only when it
    fits this run's model and world and matches the checkpoint; otherwise the line says what it was written for."""
    fresh = "or start fresh (train.resume=false, or another train.checkpoint_dir)"
    plan_file = root / "plan.json"
    try:
        theirs = Plan.load(plan_file)
    except NeocfgError:
        return f"its plan ({plan_file}) is missing or unreadable; {fresh}"
    if theirs.world_size != cfg.hardware.num_devices:
        return (f"it was written on {theirs.world_size} ranks, hardware {cfg.hardware.name} has"
                f" {cfg.hardware.num_devices}: resume on the hardware it was trained on with"
                f" planner.plan_file={plan_file}, {fresh}")
    try:
        build_layout(theirs, cfg.model, 0)
    except NeocfgError:
        return (f"it was trained on another model ({theirs.model_name}: {_difference(theirs, cfg)}): resume with the"
                f" model it was trained on and planner.plan_file={plan_file}, {fresh}")
    if ckpt.mismatch(path, theirs) is not None:
        return f"its plan.json does not match the checkpoint either; {fresh}"
    return f"resume with its plan (planner.plan_file={plan_file}, checked against this model) {fresh}"


def _difference(plan: Plan, cfg: NeocfgConfig) -> str:
    """The first way the checkpoint's tables differ from this run's model."""
    theirs = {t.name: (t.num_embeddings, t.embedding_dim) for t in plan.tables}
    mine = {t.name: (t.num_embeddings, t.embedding_dim) for t in cfg.model.tables}
    for name, shape in theirs.items():
        if name not in mine:
            return f"its table {name} is not in this model"
        if mine[name] != shape:
            return f"table {name} is {shape[0]:,}x{shape[1]} there, {mine[name][0]:,}x{mine[name][1]} here"
    extra = [n for n in mine if n not in theirs]
    return f"this model's table {extra[0]} is not in it" if extra else "its tables differ"


def _check_resume(cfg: NeocfgConfig, plan: Optional[Plan], root: Path, world: int) -> Optional[str]:
    """Before any rank starts: say which checkpoint the run resumes from when it is not `latest`, refuse another
    plan's, and return a line when the run is already finished (None: there is training to do)."""
    ckpt = Checkpointer(root, 0, world)
    path, note = ckpt.resume_point()
    if path is None:
        return None
    if note and int(os.environ.get("RANK", "0")) == 0:
        print(f"neocfg: note: {note}")
    why = ckpt.mismatch(path, plan) if plan is not None else None
    if why is not None:
        raise CheckpointError(f"{why}; {resume_advice(cfg, root, path, ckpt)}")
    step = int(ckpt.meta(path)["step"])
    if step >= cfg.train.steps:
        return (f"nothing to train: the run in {root} is already finished (its checkpoint {path.name} is at step"
                f" {step:,}, train.steps={cfg.train.steps:,}); raise train.steps to train further")
    return None


def run(cfg: NeocfgConfig, run_dir: Optional[Path], make_plan: PlanMaker) -> Optional[RunMetrics]:
    """Train cfg on the plan make_plan(cfg) returns (called once: here, or on rank 0 under torchrun)."""
    check_trainable(cfg)
    if cfg.train.resume and not cfg.train.checkpoint_dir:
        raise ConfigError("train.checkpoint_dir", None,
                          "train.resume=true needs the directory of the run to resume (each run has its own output "
                          "directory)")
    # One run writes a checkpoint directory at a time: taken first (a refused run plans and writes nothing), held
    # until the ranks are gone. A run's own <run dir>/checkpoints needs no lock.
    shared = Path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else None
    with locked(shared) if shared is not None and int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext():
        metrics = _train(cfg, run_dir, make_plan)
    if metrics is None:  # finished already, or a non-zero rank under torchrun
        return None
    print(render(metrics))
    if run_dir is not None:
        metrics.save(run_dir / METRICS_FILE)
        print(f"outputs in {run_dir}: metrics.json, plan.json"
              + (", checkpoints/" if cfg.train.checkpoint_every and not cfg.train.checkpoint_dir else ""))
    return metrics


def _train(cfg: NeocfgConfig, run_dir: Optional[Path], make_plan: PlanMaker) -> Optional[RunMetrics]:
    world = cfg.hardware.num_devices
    if under_torchrun():
        plan = None
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError("hardware", cfg.hardware.name,
                              f"has {world} devices but torchrun started {os.environ['WORLD_SIZE']} processes")
    else:
        plan = make_plan(cfg)
        if plan.world_size != world:
            raise ConfigError("planner.plan_file", cfg.planner.plan_file,
                              f"the plan is for world size {plan.world_size}, hardware {cfg.hardware.name} has "
                              f"{world}")
        build_layout(plan, cfg.model, 0)  # a plan that does not fit the model fails here, before any rank starts
    root = checkpoint_root(cfg, run_dir)
    if cfg.train.resume and root is not None:
        finished = _check_resume(cfg, plan, root, world)
        if finished is not None:
            print(finished)
            return None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if plan is not None:
            plan.save(run_dir / "plan.json")
    results = launch(_rank_main, (cfg, plan, run_dir, make_plan if plan is None else None), world=world,
                     backend=cfg.hardware.backend, timeout_s=cfg.train.collective_timeout_s)
    return results[0]
