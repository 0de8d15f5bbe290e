"""Checkpoints: every rank's embedding shards with their fused-optimizer state, the dense model and optimizer, RNG
and data position. Atomic: ranks write into a temporary directory that rank 0 renames into place once all are done,
then points `latest` at it; a crash mid-write leaves the previous checkpoint (and `latest`) intact.

Layout: <root>/step_<N>/{rank_<r>.pt, meta.json}, <root>/latest (the directory name), <root>/plan.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from neocfg.errors import NeocfgError
from neocfg.fileio import write_text_atomic
from neocfg.plan import Plan

CHECKPOINT_FORMAT_VERSION = 1
# Completed checkpoints kept on disk (older ones are deleted after a new one is in place).
KEEP_CHECKPOINTS = 2
LATEST = "latest"


class CheckpointError(NeocfgError):
    exit_code = 5


def _placement(plan: Plan) -> Any:
    return json.loads(json.dumps(plan.placement_signature()))


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Checkpointer:
    root: Path
    rank: int
    world: int
    group: Any = None
    fault_in_save: Optional[int] = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def save(self, step: int, plan: Plan, rank_state: dict[str, Any]) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp_step_{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            if not (self.root / "plan.json").exists():
                plan.save(self.root / "plan.json")
        self._barrier()
        part = tmp / f"rank_{self.rank}.pt"
        torch.save(rank_state, part.with_name(part.name + ".tmp"))
        os.replace(part.with_name(part.name + ".tmp"), part)
        if self.fault_in_save == step:  # fault injection (tests): die with the checkpoint half written
            os.kill(os.getpid(), signal.SIGKILL)
        self._barrier()
        if self.rank == 0:
            meta = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": step, "world_size": self.world,
                    "placement": _placement(plan)}
            write_text_atomic(tmp / "meta.json", json.dumps(meta) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            done = sorted(p for p in self.root.glob("step_*") if p.is_dir())
            for old in done[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return final

    def latest(self) -> Optional[Path]:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "meta.json").exists() else None

    def check(self, plan: Plan) -> Optional[Path]:
        """The latest checkpoint (None if there is none); refuses one written for another plan."""
        path = self.latest()
        if path is None:
            return None
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("world_size") != plan.world_size or meta.get("placement") != _placement(plan):
            what = (f"world size {meta.get('world_size')}, this run {plan.world_size}"
                    if meta.get("world_size") != plan.world_size else "another table placement")
            raise CheckpointError(
                f"checkpoint {path} was written for a different plan ({what}); resume with its plan "
                f"(planner.plan_file={self.root / 'plan.json'}) or start fresh (train.resume=false)")
        return path

    def load(self, plan: Plan) -> Optional[tuple[int, dict[str, Any]]]:
        """(step, this rank's state) of the latest checkpoint, None if there is none; refuses another plan's."""
        path = self.check(plan)
        if path is None:
            return None
        meta = json.loads((path / "meta.json").read_text())
        state = torch.load(path / f"rank_{self.rank}.pt", map_location="cpu", weights_only=False)
        return int(meta["step"]), state
