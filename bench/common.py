"""Shared helpers of the benchmarks: compose conf/ like the CLI, cap table sizes, write JSON results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from neocfg.config.schema import NeocfgConfig, load, register

REPO = Path(__file__).resolve().parent.parent


def compose_cfg(overrides: list[str]) -> NeocfgConfig:
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return load(compose("config", overrides=overrides))


def cap_rows(model: str, cap: int) -> list[str]:
    """Overrides that cap every table of a model preset at `cap` rows (so a CPU box can hold it)."""
    cfg = compose_cfg([f"model={model}"])
    return [f"model.tables.{i}.num_embeddings={cap}" for i, t in enumerate(cfg.model.tables)
            if t.num_embeddings > cap]


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
        print(f"written to {out}", file=sys.stderr)
