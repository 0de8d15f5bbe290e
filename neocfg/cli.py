"""The `neocfg` command: a Hydra app. Composes conf/, validates it, then runs the chosen mode.

Errors the user can fix are printed as one line (`neocfg: error: ...`) with a non-zero exit code; set
NEOCFG_DEBUG=1 (or `debug=true`) to see the traceback instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from neocfg.cli_errors import format_error
from neocfg.config import CONF_DIR
from neocfg.config.schema import NeocfgConfig, load, register
from neocfg.errors import ConfigError, Interrupted, NeocfgError
from neocfg.sweep.summary import STATUS_FILE



# Set (to anything but 0) to see tracebacks; `debug=true` (command line or a config file) sets it for the run.
DEBUG_ENV = "NEOCFG_DEBUG"


def _debug_requested(argv: list[str]) -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0") or any(a in ("debug=true", "debug=True") for a in argv)


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
    status = {"ok": error is None, "error": None if error is None else format_error(error),
              "error_type": None if error is None else type(error).__name__}
    (run_dir / STATUS_FILE).write_text(json.dumps(status) + "\n")


def config_search_dirs(argv: list[str]) -> list[Path]:
    """The directories presets come from: --config-dir / -cd (the user's, searched first) and the package's conf/."""
    dirs = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]).resolve())
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]).resolve())
    return [*dirs, CONF_DIR]


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _app(raw: DictConfig) -> object:
    run_dir = _run_dir()
    if raw.get("debug") is True:   # `debug: true` in a config file counts as on the command line (main reads it)
        os.environ[DEBUG_ENV] = "1"
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
        interrupt = interrupt_behind(exc)
        if interrupt is not None:
            _discard_if_only_bookkeeping(run_dir)
            raise interrupt from None
        if debug:
            raise
        print(f"neocfg: error: {format_error(exc, config_search_dirs(sys.argv[1:]))}", file=sys.stderr)
        if _is_multirun():  # the sweep goes on; its summary row carries this one line (no traceback)
            _write_status(run_dir, exc)
            return None
        _discard_if_only_bookkeeping(run_dir)
        sys.exit(getattr(exc, "exit_code", 2))  # before Hydra's "Error executing job" line
    except BaseException:  # Ctrl-C, SIGTERM: nothing half-written is left behind
        _discard_if_only_bookkeeping(run_dir)
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


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def interrupt_behind(exc: BaseException) -> Interrupted | KeyboardInterrupt | None:
    """The Ctrl-C / SIGTERM behind an error, if any. A signal that lands inside library clean-up code (OmegaConf's
    flag_override restoring flags while Hydra composes) can make that code raise an error of its own, which
    replaces the interrupt; the interrupt is still in the exception chain."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (Interrupted, KeyboardInterrupt)):
            return e
        todo += [e.__cause__, e.__context__]
    return None


def _stop_children() -> None:
    """SIGTERM whatever child processes are left (e.g. the CBC solver PuLP started when SIGTERM came mid-plan):
    an interrupted run leaves nothing running. The launcher has already stopped its ranks. Linux (/proc) only."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                os.kill(int(stat.parent.name), signal.SIGTERM)
        except (OSError, IndexError, ValueError):
            continue


def main() -> None:
    debug = _debug_requested(sys.argv[1:])
    # `neocfg ... | head` ends quietly, like any Unix tool, instead of reporting a broken pipe.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Ctrl-C and SIGTERM stop the whole run (the launcher stops its ranks) and end in one line.
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    # Let exceptions reach us instead of Hydra's multi-line report; we print one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from neocfg.logs import quiet_library_logs

    quiet_library_logs()
    register()
    from neocfg.sweep.callback import AllRunsFailed

    try:
        check_sweep_x(sys.argv[1:])
        try:
            _app()
        except AllRunsFailed as failed:
            raise failed.error from None
    except SystemExit:
        raise
    except (Interrupted, KeyboardInterrupt) as exc:
        _exit_interrupted(exc)
    except Exception as exc:  # noqa: BLE001 - every error becomes one line unless debugging
        interrupt = interrupt_behind(exc)
        if interrupt is not None:
            _exit_interrupted(interrupt)
        if debug or _debug_requested([]):   # (a config file's debug: true is known once it is composed)
            raise
        print(f"neocfg: error: {format_error(exc, config_search_dirs(sys.argv[1:]))}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))


def _exit_interrupted(exc: Interrupted | KeyboardInterrupt) -> None:
    _stop_children()
    name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
    sys.stderr.write(f"neocfg: interrupted by {name}; the run was stopped (its completed checkpoints are kept)\n")
    sys.exit(exc.exit_code if isinstance(exc, Interrupted) else 130)
