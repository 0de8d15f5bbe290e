"""The `neocfg` command: a Hydra app. Composes conf/, validates it, then runs the chosen mode.

Errors the user can fix are printed as one line (`neocfg: error: ...`) with a non-zero exit code; set
NEOCFG_DEBUG=1 (or `debug=true`) to see the traceback instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import traceback
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from neocfg.cli_errors import format_error
from neocfg.config.schema import NeocfgConfig, load, register
from neocfg.errors import ConfigError, NeocfgError
from neocfg.sweep.summary import STATUS_FILE

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


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


def _write_status(run_dir: Path | None, error: BaseException | None) -> None:
    """status.json in the run directory: what the sweep summary reads to say whether a run worked, and why not."""
    if run_dir is None:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    status = {"ok": error is None, "error": None if error is None else str(error),
              "error_type": None if error is None else type(error).__name__}
    (run_dir / STATUS_FILE).write_text(json.dumps(status) + "\n")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _app(raw: DictConfig) -> object:
    run_dir = _run_dir()
    debug = _debug_requested(sys.argv[1:])
    try:
        cfg = load(raw)
        result = run_mode(cfg, run_dir)
    except NeocfgError as exc:
        if debug:
            raise
        print(f"neocfg: error: {exc}", file=sys.stderr)
        if _is_multirun():
            # One run of a sweep that does not fit is a row of the summary, not a crashed sweep.
            _write_status(run_dir, exc)
            return None
        _discard_if_only_bookkeeping(run_dir)
        # Exit here rather than raise: Hydra would log a multi-line "Error executing job" report first.
        sys.exit(exc.exit_code)
    except Exception as exc:
        if _is_multirun() and not debug:
            traceback.print_exc()
            _write_status(run_dir, exc)
            return None
        raise
    _write_status(run_dir, None)
    return result


def check_sweep_x(argv: list[str]) -> None:
    """sweep.x must name a key given on the command line: checked before any run of the sweep starts."""
    pairs = [a.split("=", 1) for a in argv if "=" in a and not a.startswith("-")]
    given = {key.lstrip("+~"): value for key, value in pairs}
    x = given.get("sweep.x")
    others = [k for k in given if not k.startswith("sweep.")]
    if x is not None and x not in others:
        raise ConfigError("sweep.x", x, f"must be one of the keys given on the command line: {', '.join(others)}")


def main() -> None:
    debug = _debug_requested(sys.argv[1:])
    # `neocfg ... | head` ends quietly, like any Unix tool, instead of reporting a broken pipe.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Let exceptions reach us instead of Hydra's multi-line report; we print one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    register()
    try:
        check_sweep_x(sys.argv[1:])
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
