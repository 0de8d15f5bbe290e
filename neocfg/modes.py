"""Mode dispatch: `mode=<name>` runs MODES[name](cfg, run_dir)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from neocfg.config.schema import NeocfgConfig
from neocfg.types import Mode


def _describe(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    from neocfg.describe import run

    return run(cfg, run_dir)


def _plan(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    from neocfg.contract import plan

    return plan(cfg, run_dir)


def _train(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    from neocfg.contract import train

    return train(cfg, run_dir)


def _gen_data(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    from neocfg.data.parquet_gen import run

    return run(cfg, run_dir)


MODES: dict[Mode, Callable[[NeocfgConfig, Path | None], object]] = {
    Mode.describe: _describe,
    Mode.plan: _plan,
    Mode.train: _train,
    Mode.gen_data: _gen_data,
}


def dispatch(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    return MODES[cfg.mode](cfg, run_dir)
