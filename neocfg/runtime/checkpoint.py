"""Checkpoints: every rank's embedding shards with their fused-optimizer state, the dense model and optimizer, RNG
and data position. Atomic: ranks write into a temporary directory that rank 0 renames into place once all are done,
then points `latest` at it; a crash mid-write leaves the previous checkpoint (and `latest`) intact.

Layout: <root>/step_<N>/{rank_<r>.pt, meta.json}, <root>/latest (the directory name), <root>/plan.json,
<root>/.lock (held by the run writing the directory: fcntl.flock, with its pid and host inside).

meta.json records every rank file's size: a truncated or missing file makes a checkpoint unusable, and resuming
falls back to the newest usable one (saying so) instead of failing inside a rank or starting from step 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from neocfg.errors import CheckpointError, CheckpointLockedError, ConfigError
from neocfg.fileio import write_text_atomic
from neocfg.plan import Plan

CHECKPOINT_FORMAT_VERSION = 1
# Completed checkpoints kept on disk (older ones are deleted after a new one is in place).
KEEP_CHECKPOINTS = 2
LATEST = "latest"
LOCK = ".lock"


@contextlib.contextmanager
def locked(root: Path, key: str = "train.checkpoint_dir") -> Iterator[None]:
    """Hold <root>/.lock for the duration (one writer per checkpoint directory). The lock is an flock: the kernel
    drops it when the holder dies, however it dies, so a stale lock never needs cleaning up."""
    if root.exists() and not root.is_dir():
        raise ConfigError(key, str(root), "is a file; must be a directory (or a path that does not exist yet)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(key, str(root), f"cannot be written ({exc.strerror}); choose a writable directory")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointLockedError(
                f"checkpoint directory {root} is in use by another run ({_holder(fd)}); wait for it to end, stop"
                f" it, or give this run another train.checkpoint_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {who['pid']} on host {who['host']}, since {who['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


def problem(path: Path, world: Optional[int] = None) -> Optional[str]:
    """Why the checkpoint directory `path` cannot be resumed from (None: it can)."""
    if not path.is_dir():
        return "it does not exist"
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return "its meta.json is missing or unreadable"
    sizes = meta.get("rank_file_bytes") or {}
    for r in range(int(meta.get("world_size") or world or 0)):
        f = path / f"rank_{r}.pt"
        if not f.is_file():
            return f"{f.name} is missing"
        want, have = sizes.get(str(r)), f.stat().st_size
        if want is not None and have != want:
            return f"{f.name} is truncated ({have:,} of {want:,} bytes)"
        try:
            with zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError):
            return f"{f.name} is truncated or corrupt (not a complete torch.save file)"
    return None


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
                    "placement": _placement(plan),
                    "rank_file_bytes": {str(r): (tmp / f"rank_{r}.pt").stat().st_size for r in range(self.world)}}
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

    def resume_point(self) -> tuple[Optional[Path], Optional[str]]:
        """The checkpoint to resume from and, when it is not the one `latest` names, a line saying why. None when
        the directory holds no checkpoint at all; CheckpointError when it holds only unusable ones."""
        pointer = self.root / LATEST
        named = self.root / pointer.read_text().strip() if pointer.is_file() else None
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir()), reverse=True)
        if named is None and not steps:
            return None, None
        why = problem(named, self.world) if named is not None else "no `latest` pointer"
        if why is None:
            return named, None
        what = f"checkpoint {named}" if named is not None else f"checkpoint directory {self.root}"
        for older in steps:
            if older != named and problem(older, self.world) is None:
                return older, f"{what} is unusable ({why}); resuming from the newest valid checkpoint, {older}"
        raise CheckpointError(f"{what} is unusable ({why}) and {self.root} holds no older valid checkpoint; start"
                              f" fresh with train.resume=false (or another train.checkpoint_dir)")

    def latest(self) -> Optional[Path]:
        return self.resume_point()[0]

    def meta(self, path: Path) -> dict[str, Any]:
        return json.loads((path / "meta.json").read_text())

    def mismatch(self, path: Path, plan: Plan) -> Optional[str]:
        """Why the checkpoint at `path` cannot be resumed with `plan` (None: it can)."""
        meta = self.meta(path)
        if meta.get("world_size") != plan.world_size:
            return (f"checkpoint {path} was written for a different plan (world size {meta.get('world_size')}, this"
                    f" run {plan.world_size})")
        if meta.get("placement") != _placement(plan):
            return f"checkpoint {path} was written for a different plan (another table placement)"
        return None

    def check(self, plan: Plan) -> Optional[Path]:
        """The checkpoint to resume from (None if there is none); refuses one written for another plan."""
        path = self.latest()
        if path is None:
            return None
        why = self.mismatch(path, plan)
        if why is not None:
            raise CheckpointError(f"{why}; resume with its plan (planner.plan_file={self.root / 'plan.json'}) or"
                                  f" start fresh (train.resume=false)")
        return path

    def load(self, plan: Plan) -> Optional[tuple[int, dict[str, Any]]]:
        """(step, this rank's state) of the latest checkpoint, None if there is none; refuses another plan's."""
        path = self.check(plan)
        if path is None:
            return None
        meta = self.meta(path)
        file = path / f"rank_{self.rank}.pt"
        try:
            state = torch.load(file, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - whatever torch.load says about a damaged file, name the file
            raise CheckpointError(f"checkpoint file {file} cannot be read ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no detail'});"
                                  f" start fresh with train.resume=false") from exc
        return int(meta["step"]), state
