"""Schema of the `dsi` group: where training data comes from and what preprocessing it costs (DSI/DPP, ISCA'22)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from neocfg.config import checks
from neocfg.errors import ConfigError
from neocfg.types import DataSource, OnBadSplit


@dataclass
class WorkerShape:
    """A kind of DPP worker node the planner may buy."""

    name: str = MISSING
    cores: int = MISSING
    nic_gbs: float = MISSING
    memory_bandwidth_gbs: float = MISSING
    # Relative cost of one node of this shape (the DPP sizing minimizes the sum).
    cost: float = 1.0

    def check(self, key: str) -> None:
        checks.non_empty(f"{key}.name", self.name)
        checks.positive(f"{key}.cores", self.cores)
        checks.positive(f"{key}.nic_gbs", self.nic_gbs)
        checks.positive(f"{key}.memory_bandwidth_gbs", self.memory_bandwidth_gbs)
        checks.positive(f"{key}.cost", self.cost)


def _default_worker_shapes() -> List[WorkerShape]:
    # A typical DPP worker: a 2-socket CPU host with a 25 Gb/s NIC (DSI paper, section 6: DPP workers are
    # general-purpose compute hosts, front-end NIC bandwidth bounds their output).
    return [WorkerShape(name="cpu_host_64c", cores=64, nic_gbs=3.125, memory_bandwidth_gbs=200.0, cost=1.0)]


@dataclass
class DsiConfig:
    name: str = MISSING
    source: DataSource = DataSource.synthetic
    # Dataset directory for source=parquet (relative paths are taken from the directory neocfg was started in).
    path: Optional[str] = None
    # Dataset size and shape for generation (mode=gen_data) and for synthetic in-process data.
    num_samples: int = 65536
    num_files: int = 4
    row_groups_per_file: int = 4
    # Extra stored columns the model does not read (projection must skip them): count and bytes per sample each.
    extra_columns: int = 8
    extra_column_bytes: int = 64
    seed: int = 1234
    # DPP workers: "auto" takes the planner's DPP sizing, an integer fixes the count.
    workers: Any = "auto"
    max_workers: int = 16
    on_bad_split: OnBadSplit = OnBadSplit.fail
    # Cost inputs for DPP sizing (per sample): CPU core-microseconds to read+transform+batch, bytes read from
    # storage, tensor bytes sent to the trainer.
    preprocess_cpu_us_per_sample: float = 20.0
    bytes_read_per_sample: float = 600.0
    tensor_bytes_per_sample: float = 300.0
    worker_shapes: List[WorkerShape] = field(default_factory=_default_worker_shapes)
    # What one trainer host can ingest from DPP workers (its front-end NIC), GB/s.
    trainer_ingest_gbs: float = 12.5
    # Extra capacity provisioned above demand (0.2 = 20 %).
    headroom: float = 0.2

    def check(self, key: str = "dsi") -> None:
        checks.non_empty(f"{key}.name", self.name)
        if self.source is DataSource.parquet and not self.path:
            raise ConfigError(f"{key}.path", self.path, "a dataset directory is required when dsi.source=parquet")
        checks.positive(f"{key}.num_samples", self.num_samples)
        checks.positive(f"{key}.num_files", self.num_files)
        checks.positive(f"{key}.row_groups_per_file", self.row_groups_per_file)
        checks.non_negative(f"{key}.extra_columns", self.extra_columns)
        checks.non_negative(f"{key}.extra_column_bytes", self.extra_column_bytes)
        if not (self.workers == "auto" or (isinstance(self.workers, int) and not isinstance(self.workers, bool)
                                           and self.workers > 0)):
            raise ConfigError(f"{key}.workers", self.workers, "must be 'auto' or a positive integer")
        checks.positive(f"{key}.max_workers", self.max_workers)
        checks.positive(f"{key}.preprocess_cpu_us_per_sample", self.preprocess_cpu_us_per_sample)
        checks.positive(f"{key}.bytes_read_per_sample", self.bytes_read_per_sample)
        checks.positive(f"{key}.tensor_bytes_per_sample", self.tensor_bytes_per_sample)
        checks.non_empty(f"{key}.worker_shapes", self.worker_shapes)
        for i, shape in enumerate(self.worker_shapes):
            shape.check(f"{key}.worker_shapes.{i}")
        checks.unique(f"{key}.worker_shapes", [s.name for s in self.worker_shapes])
        checks.positive(f"{key}.trainer_ingest_gbs", self.trainer_ingest_gbs)
        checks.in_range(f"{key}.headroom", self.headroom, 0.0, 10.0)
