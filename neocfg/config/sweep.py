"""Schema of the `sweep` section: what the multirun summary plots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from neocfg.types import SweepMetric


@dataclass
class SweepConfig:
    # The metric sweep_summary.png plots against the swept value.
    metric: SweepMetric = SweepMetric.step_ms
    # The swept key on the x axis (default: the first swept key); others become one line each.
    x: Optional[str] = None
