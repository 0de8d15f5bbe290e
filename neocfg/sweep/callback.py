"""Hydra callback: at the end of a multirun, write sweep_summary.{csv,md,png} into the sweep directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from neocfg.errors import SweepFailedError
from neocfg.sweep.summary import SweepRow, summarize, swept_keys
from neocfg.types import SweepMetric


class AllRunsFailed(BaseException):
    """Carries a sweep's SweepFailedError from the callback to the CLI. Hydra instantiates the callback itself and
    turns any Exception a callback raises into a warning, so the verdict leaves as a BaseException (the CLI
    catches it around the multirun and reports `error` as any other error) instead of through shared state."""

    def __init__(self, error: SweepFailedError) -> None:
        super().__init__(str(error))
        self.error = error


def verdict(sweep_dir: Path, rows: list[SweepRow]) -> SweepFailedError | None:
    """A sweep in which no run worked fails (non-zero exit) with one line; some failed runs are rows."""
    if rows and not any(r.fits for r in rows):
        return SweepFailedError(f"all {len(rows)} runs of the sweep failed (job {rows[0].job}: {rows[0].why});"
                                f" one reason per run in {sweep_dir}/sweep_summary.md")
    return None


class SweepSummary(Callback):
    """Writes the sweep's summary when a multirun ends; a sweep in which every run failed ends in AllRunsFailed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        sweep = config.get("sweep") or {}
        chosen = sweep.get("metric", SweepMetric.step_ms)
        metric = chosen.value if isinstance(chosen, SweepMetric) else SweepMetric[str(chosen)].value
        x_key = sweep.get("x")
        rows = summarize(sweep_dir, metric, x_key)
        keys = swept_keys(rows)
        failed = sum(not r.fits for r in rows)
        print(f"sweep: {len(rows)} runs ({failed} did not fit or failed) over {', '.join(keys) or 'no swept keys'};"
              f" summary in {sweep_dir}/sweep_summary.{{csv,md,png}}")
        if x_key and x_key not in keys:  # given on the command line (cli checks that) but one value in every run
            print(f"neocfg: note: sweep.x={x_key!r} took one value in every run; the plot's x axis is"
                  f" {keys[0] if keys else 'the job number'}", file=sys.stderr)
        error = verdict(sweep_dir, rows)
        if error is not None:
            raise AllRunsFailed(error)
