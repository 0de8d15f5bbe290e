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


RESULTS = REPO / "bench" / "RESULTS.md"
RESULTS_HEADER = ("# Benchmark results\n\nWritten by the benchmarks themselves (`record_results` in bench/common.py): each section is"
                  " replaced by the\nbench that owns it, with the command, date and machine of the run. The docs link"
                  " here instead of copying numbers.\n")


def machine() -> str:
    """One line naming the machine a result was measured on."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def record_results(section: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or add) `## <section>` of bench/RESULTS.md with `body`, headed by the command, date and machine."""
    import datetime
    import re
    import shlex

    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    block = (f"## {section}\n\nCommand: `{command}`; date: {date}; machine: {machine()}.\n\n{body.strip()}\n")
    text = path.read_text() if path.exists() else RESULTS_HEADER
    pattern = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: block + "\n", text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")
    print(f"results: section '{section}' of {path}", file=sys.stderr)
