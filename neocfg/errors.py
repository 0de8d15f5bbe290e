"""User-facing errors. Each is reported as one line on stderr with a non-zero exit code (no traceback)."""

from __future__ import annotations

from typing import Any


class NeocfgError(Exception):
    """Base of every error that is the user's to fix (config, data, capacity); printed as one line."""

    exit_code = 2


class ConfigError(NeocfgError):
    """A config value is invalid: names the full key path, the bad value and what is allowed."""

    NO_VALUE = object()

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        if value is ConfigError.NO_VALUE:
            super().__init__(f"{key}: {allowed}")
        else:
            super().__init__(f"{key}={value!r} is invalid: {allowed}")


class InfeasibleError(NeocfgError):
    """The model cannot be placed on the hardware (or fed by the data pipeline) as configured."""

    exit_code = 3


class IngestLimitError(InfeasibleError):
    """The plan fits, but the trainer nodes cannot receive its samples fast enough (dsi.trainer_ingest_gbs)."""


class DataError(NeocfgError):
    """A data file, split or schema is bad: names the file (and split) and what is wrong."""

    exit_code = 4


class CheckpointError(NeocfgError):
    """A checkpoint cannot be used: another plan's, truncated or corrupt; names the file and what is wrong."""

    exit_code = 5


class CheckpointLockedError(CheckpointError):
    """Another live run holds the checkpoint directory's lock (two writers would replace each other's files)."""

    exit_code = 7


class DivergedError(NeocfgError):
    """The training loss became non-finite, or grew past train.divergence_factor times its first value: the run
    stops (the checkpoints it completed before are kept)."""

    exit_code = 9


class SweepFailedError(NeocfgError):
    """Every run of a multirun failed."""

    exit_code = 8


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM reached the neocfg process: the run stops, its ranks with it. A BaseException so
    that no `except Exception` on the way swallows it; exit code 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)
