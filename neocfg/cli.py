"""The `neocfg` command: a Hydra app. Composes conf/, validates it, then runs the chosen mode.

Errors the user can fix are printed as one line (`neocfg: error: ...`) with a non-zero exit code; set
NEOCFG_DEBUG=1 (or `debug=true`) to see the traceback instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from neocfg.cli_errors import format_error
from neocfg.config.schema import NeocfgConfig, load, register
from neocfg.errors import NeocfgError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _debug_requested(argv: list[str]) -> bool:
    return os.environ.get("NEOCFG_DEBUG", "") not in ("", "0") or any(a in ("debug=true", "debug=True") for a in argv)


def _run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not running under Hydra (tests calling run_mode directly)
        return None


def _discard_if_only_bookkeeping(run_dir: Path | None) -> None:
    """A run that failed before producing anything leaves no output directory behind (nothing half-written)."""
    if run_dir is None or not run_dir.is_dir():
        return
    leftovers = [p for p in run_dir.iterdir() if p.name != ".hydra" and not p.name.endswith(".log")]
    if not leftovers:
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in list(run_dir.parents)[:2]:  # outputs/<date> and outputs, when this run made them empty
            try:
                parent.rmdir()
            except OSError:
                break


def run_mode(cfg: NeocfgConfig, run_dir: Path | None) -> object:
    """Dispatch on cfg.mode. Each mode module exposes run(cfg, run_dir)."""
    from neocfg import modes

    return modes.dispatch(cfg, run_dir)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _app(raw: DictConfig) -> object:
    run_dir = _run_dir()
    try:
        cfg = load(raw)
        return run_mode(cfg, run_dir)
    except NeocfgError as exc:
        _discard_if_only_bookkeeping(run_dir)
        if _debug_requested(sys.argv[1:]):
            raise
        # Exit here rather than raise: Hydra would log a multi-line "Error executing job" report first.
        print(f"neocfg: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def main() -> None:
    debug = _debug_requested(sys.argv[1:])
    # Let exceptions reach us instead of Hydra's multi-line report; we print one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    register()
    try:
        _app()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print("neocfg: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - every error becomes one line unless debugging
        if debug:
            raise
        print(f"neocfg: error: {format_error(exc)}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
