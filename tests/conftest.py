from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from neocfg.config.schema import NeocfgConfig, load, register

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def compose_cfg(overrides: list[str] | None = None) -> NeocfgConfig:
    """Compose conf/ exactly as the CLI does and return the validated, typed config."""
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose("config", overrides=overrides or [])
    return load(raw)


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `neocfg` CLI (python -m neocfg) in cwd."""
    full_env = dict(os.environ)
    full_env.pop("NEOCFG_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "neocfg", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cli(tmp_path):
    def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_cli(list(args), tmp_path, env=env, timeout=timeout)

    return _run
