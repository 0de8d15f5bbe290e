"""Where a trainer rank gets its batches: the interface the runtime consumes and its implementations.

A BatchSource yields fixed-size batches for one rank forever (epochs roll over), can report its position for a
checkpoint and resume from it, and counts the time the trainer waited on it (the data stall).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

from neocfg.batch import Batch
from neocfg.config.schema import NeocfgConfig
from neocfg.data.synthetic import SyntheticData
from neocfg.types import DataSource

if TYPE_CHECKING:
    from neocfg.plan import Plan


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters merged into metrics.json (e.g. data_stall_seconds, samples_delivered)."""
        ...

    def close(self) -> None: ...


class SyntheticSource:
    """Rank r's step s is samples [(s * world + r) * B, ... + B): disjoint over ranks, identical on every run."""

    def __init__(self, data: SyntheticData, rank: int, world_size: int, batch_size: int, first_sample: int = 0):
        self.data, self.rank, self.world, self.batch_size = data, rank, world_size, batch_size
        self.first_sample = first_sample
        self.step = 0
        self.wait_s = 0.0
        self.delivered = 0

    def next_batch(self) -> Batch:
        t0 = time.perf_counter()
        start = self.first_sample + (self.step * self.world + self.rank) * self.batch_size
        batch = self.data.batch(start, self.batch_size)
        self.step += 1
        self.delivered += self.batch_size
        self.wait_s += time.perf_counter() - t0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def stats(self) -> dict[str, Any]:
        return {"data_wait_seconds": self.wait_s, "samples_delivered": self.delivered}

    def close(self) -> None:
        pass


# Held-out samples start here, far past any training range, so evaluation never sees a training sample.
EVAL_FIRST_SAMPLE = 1 << 40


def make_source(cfg: NeocfgConfig, rank: int, world_size: int, *, eval: bool = False,
                plan: Optional["Plan"] = None) -> BatchSource:
    """The batch source for one trainer rank, chosen by cfg.dsi.source.

    dsi.source=parquet: a DPP service over the rank's share of the Parquet splits (neocfg/data/dpp_source.py);
    `plan` (optional) supplies the DPP sizing for dsi.workers=auto without planning again.
    """
    if cfg.dsi.source is DataSource.parquet:
        from neocfg.data.dpp_source import make_dpp_source

        return make_dpp_source(cfg, rank, world_size, eval=eval, plan=plan)
    data = SyntheticData.for_model(cfg.model, cfg.dsi.seed)
    first = EVAL_FIRST_SAMPLE if eval else 0
    return SyntheticSource(data, rank, world_size, cfg.train.batch_size, first_sample=first)
