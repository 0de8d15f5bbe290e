"""Hydra callback: at the end of a multirun, write sweep_summary.{csv,md,png} into the sweep directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from neocfg.errors import SweepFailedError
from neocfg.sweep.summary import SweepRow, summarize, swept_keys
from neocfg.types import SweepMetric


class SweepSummary(Callback):
    # What the last multirun of this process ended with (read by the CLI to choose its exit code).
    last: ClassVar[Optional[tuple[Path, list[SweepRow]]]] = None

    @classmethod
    def raise_if_all_failed(cls) -> None:
        """A sweep in which no run worked fails (non-zero exit) with one line; some failed runs are rows."""
        if cls.last is None:
            return
        sweep_dir, rows = cls.last
        cls.last = None
        if rows and not any(r.fits for r in rows):
            raise SweepFailedError(f"all {len(rows)} runs of the sweep failed (job {rows[0].job}: {rows[0].why});"
                                   f" one reason per run in {sweep_dir}/sweep_summary.md")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        sweep = config.get("sweep") or {}
        chosen = sweep.get("metric", SweepMetric.step_ms)
        metric = chosen.value if isinstance(chosen, SweepMetric) else SweepMetric[str(chosen)].value
        x_key = sweep.get("x")
        rows = summarize(sweep_dir, metric, x_key)
        SweepSummary.last = (sweep_dir, rows)
        keys = swept_keys(rows)
        failed = sum(not r.fits for r in rows)
        print(f"sweep: {len(rows)} runs ({failed} did not fit or failed) over {', '.join(keys) or 'no swept keys'};"
              f" summary in {sweep_dir}/sweep_summary.{{csv,md,png}}")
        if x_key and x_key not in keys:  # given on the command line (cli checks that) but one value in every run
            print(f"neocfg: note: sweep.x={x_key!r} took one value in every run; the plot's x axis is"
                  f" {keys[0] if keys else 'the job number'}", file=sys.stderr)
