"""mode=train: plan (or load planner.plan_file), start the ranks, train, evaluate, write metrics.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from neocfg.config.schema import NeocfgConfig
from neocfg.errors import ConfigError
from neocfg.plan import Plan
from neocfg.runtime.checkpoint import Checkpointer
from neocfg.runtime.layout import build_layout
from neocfg.runtime.launch import RankEnv, check_single_host, launch, under_torchrun
from neocfg.types import Backend


def load_or_make_plan(cfg: NeocfgConfig) -> Plan:
    if cfg.planner.plan_file:
        from neocfg.plan_check import load_plan_file

        return load_plan_file(cfg.planner.plan_file, cfg.model, cfg.hardware.num_devices)
    from neocfg.planner import make_plan

    return make_plan(cfg)


def _rank_main(env: RankEnv, cfg: NeocfgConfig, plan: Optional[Plan], run_dir: Optional[Path]) -> Any:
    from neocfg.runtime.train import train_rank

    if plan is None:  # under torchrun every process runs the CLI: rank 0 plans, the others take its plan
        import torch.distributed as dist

        box = [load_or_make_plan(cfg).to_dict() if env.rank == 0 else None]
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


def render(m: dict[str, Any]) -> str:
    lines = [f"trained {m['model']} on {m['world_size']} ranks: {m['steps']} steps, {m['samples']:,} samples, "
             f"{m['samples_per_s']:,.0f} samples/s",
             f"  loss {m['initial_loss']:.4f} -> {m['final_loss']:.4f} (mean of last 10 steps "
             f"{m['final_loss_mean_last_10']:.4f})"]
    if m.get("eval_auc") is not None:
        lines.append(f"  held-out ({m['eval_samples']:,} samples): AUC {m['eval_auc']:.4f}, NE {m['eval_ne']:.4f}, "
                     f"log loss {m['eval_logloss']:.4f}")
    b = m["breakdown_ms"]
    lines.append("  step breakdown (ms, mean over ranks): " + ", ".join(
        f"{k} {b[k]:.2f}" for k in ("data_wait", "comm_input", "emb_fwd", "comm_fwd", "dense", "comm_bwd",
                                    "emb_bwd", "total")))
    if m.get("prediction_error") is not None:
        lines.append(f"  step time: predicted {m['predicted_step_ms']:.2f} ms, measured {m['measured_step_ms']:.2f} ms "
                     f"(prediction error {100 * m['prediction_error']:+.0f}%)")
        if m["plan_batch_size_per_device"] != m["batch_size_per_rank"]:
            lines.append(f"  (the plan was made for batch {m['plan_batch_size_per_device']} per device, this run used "
                         f"{m['batch_size_per_rank']})")
        lines.append("  predicted / measured ms: " + ", ".join(
            f"{k} {p:.2f} / {q:.2f}" for k, (p, q) in m["predicted_vs_measured_ms"].items()))
    else:
        lines.append(f"  step time: measured {m['measured_step_ms']:.2f} ms (the plan has no estimate)")
    return "\n".join(lines)


def run(cfg: NeocfgConfig, run_dir: Optional[Path]) -> dict[str, Any]:
    check_trainable(cfg)
    if cfg.train.resume and not cfg.train.checkpoint_dir:
        raise ConfigError("train.checkpoint_dir", None,
                          "train.resume=true needs the directory of the run to resume (each run has its own output "
                          "directory)")
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    world = cfg.hardware.num_devices
    if under_torchrun():
        plan = None
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError("hardware", cfg.hardware.name,
                              f"has {world} devices but torchrun started {os.environ['WORLD_SIZE']} processes")
    else:
        plan = load_or_make_plan(cfg)
        if run_dir is not None:
            plan.save(run_dir / "plan.json")
        if plan.world_size != world:
            raise ConfigError("planner.plan_file", cfg.planner.plan_file,
                              f"the plan is for world size {plan.world_size}, hardware {cfg.hardware.name} has "
                              f"{world}")
        build_layout(plan, cfg.model, 0)  # a plan that does not fit the model fails here, before any rank starts
        if cfg.train.resume:  # refuse another plan's checkpoint before starting any rank
            Checkpointer(Path(cfg.train.checkpoint_dir), 0, world).check(plan)
    results = launch(_rank_main, (cfg, plan, run_dir), world=world, backend=cfg.hardware.backend,
                     timeout_s=cfg.train.collective_timeout_s)
    metrics = results[0]
    if metrics is None:  # a non-zero rank under torchrun
        return {}
    print(render(metrics))
    if run_dir is not None:
        path = run_dir / "metrics.json"
        path.write_text(json.dumps(metrics, indent=1) + "\n")
        print(f"outputs in {run_dir}: metrics.json, plan.json"
              + (", checkpoints/" if cfg.train.checkpoint_every and not cfg.train.checkpoint_dir else ""))
    return metrics
