"""Schema of the `dsi` group: where training data comes from and what preprocessing it costs (DSI/DPP, ISCA'22)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from neocfg.config import checks
from neocfg.errors import ConfigError
from neocfg.types import CategoricalEncoding, DataSource, DppBackendKind, FilterCmp, OnBadSplit, RawFormat, TransformOp


@dataclass
class WorkerShape:
    """A kind of DPP worker node the planner may buy."""

    name: str = MISSING
    cores: int = MISSING
    nic_gbs: float = MISSING
    memory_bandwidth_gbs: float = MISSING
    # Memory of one node, GiB (a Ray worker actor of this shape asks for it).
    memory_gib: float = 64.0
    # Relative cost of one node of this shape (the DPP sizing minimizes the sum).
    cost: float = 1.0

    def check(self, key: str) -> None:
        checks.non_empty(f"{key}.name", self.name)
        checks.positive(f"{key}.cores", self.cores)
        checks.positive(f"{key}.nic_gbs", self.nic_gbs)
        checks.positive(f"{key}.memory_bandwidth_gbs", self.memory_bandwidth_gbs)
        checks.positive(f"{key}.memory_gib", self.memory_gib)
        checks.positive(f"{key}.cost", self.cost)


def _default_worker_shapes() -> List[WorkerShape]:
    # A typical DPP worker: a 2-socket CPU host with a 25 Gb/s NIC (DSI paper, section 6: DPP workers are
    # general-purpose compute hosts, front-end NIC bandwidth bounds their output).
    return [WorkerShape(name="cpu_host_64c", cores=64, nic_gbs=3.125, memory_bandwidth_gbs=200.0, memory_gib=256.0,
                        cost=1.0)]


@dataclass
class RayConfig:
    """Where the Ray backend (dsi.backend=ray) runs: null starts a local Ray for the run; "auto" or
    "ray://host:10001" joins a running cluster (`ray start --head` first)."""

    address: Optional[str] = None
    # The job's master actor is named in this namespace; every trainer rank's client finds it there.
    namespace: str = "neocfg"
    # Object store of a local Ray started for the run, MB (batches travel through it).
    object_store_mb: int = 512

    def check(self, key: str) -> None:
        checks.non_empty(f"{key}.namespace", self.namespace)
        checks.positive(f"{key}.object_store_mb", self.object_store_mb)


@dataclass
class TransformConfig:
    """One preprocessing step. `column` is a column name or an fnmatch pattern (`dense_*`, `sparse_t[0-3]`);
    a pattern that matches no column of the model is a no-op, so one preset serves every model."""

    column: str = MISSING
    op: TransformOp = MISSING
    # filter: the comparison and its operand; fill_missing: the fill value; clip_min: the lower bound.
    cmp: FilterCmp = FilterCmp.not_null
    value: Optional[float] = None
    # log: y = ln(max(x + offset, LOG_FLOOR)).
    offset: float = 1.0
    # logit: inputs are clipped to [eps, 1 - eps].
    eps: float = 1e-6
    # bucketize: increasing boundaries.
    boundaries: Optional[List[float]] = None
    # truncate: ids kept per list.
    max_ids: Optional[int] = None

    def check(self, key: str) -> None:
        checks.non_empty(f"{key}.column", self.column)
        if self.op is TransformOp.filter and self.cmp is not FilterCmp.not_null and self.value is None:
            raise ConfigError(f"{key}.value", self.value, f"filter with cmp={self.cmp.value} needs a value")
        if self.op in (TransformOp.fill_missing, TransformOp.clip_min) and self.value is None:
            raise ConfigError(f"{key}.value", self.value, f"{self.op.value} needs a value")
        if self.op is TransformOp.logit:
            checks.in_range(f"{key}.eps", self.eps, 0.0, 0.5, lo_open=True, hi_open=True)
        if self.op is TransformOp.bucketize:
            checks.non_empty(f"{key}.boundaries", self.boundaries)
            if any(b >= a for b, a in zip(self.boundaries[:-1], self.boundaries[1:])):
                raise ConfigError(f"{key}.boundaries", list(self.boundaries), "must be strictly increasing")
        if self.op is TransformOp.truncate:
            if self.max_ids is None:
                raise ConfigError(f"{key}.max_ids", None, "truncate needs max_ids")
            checks.positive(f"{key}.max_ids", self.max_ids)


@dataclass
class RawDataConfig:
    """mode=gen_data's input when it converts files in a public format (format != none) instead of generating
    samples. Files are streamed (never held whole in memory) into `dsi.path`'s Parquet splits."""

    format: RawFormat = RawFormat.none
    # Training files in order (glob patterns allowed; a pattern's matches in natural order: day_2 before day_10).
    files: List[str] = field(default_factory=list)
    # Held-out files (their first dsi.eval_samples rows); empty: the last dsi.eval_samples rows of `files`.
    eval_files: List[str] = field(default_factory=list)
    categorical: CategoricalEncoding = CategoricalEncoding.hash
    # vocabulary: ids seen fewer times than this over all files share row 1 (TorchRec's FREQUENCY_THRESHOLD).
    frequency_threshold: int = 3
    # Rows per Parquet row group (one DPP split) of the converted dataset; dsi.row_groups_per_file per file.
    row_group_rows: int = 65536
    # Convert at most this many training rows (null: every row), e.g. to try a prefix of a 1TB day.
    max_rows: Optional[int] = None

    def check(self, key: str) -> None:
        if self.format is RawFormat.none:
            return
        checks.non_empty(f"{key}.files", self.files)
        checks.positive(f"{key}.frequency_threshold", self.frequency_threshold)
        checks.positive(f"{key}.row_group_rows", self.row_group_rows)
        if self.max_rows is not None:
            checks.positive(f"{key}.max_rows", self.max_rows)


@dataclass
class ColumnsConfig:
    """The stored column of each feature, for a dataset whose names are not neocfg's (dense_<j>, sparse_<table>,
    label, sample_id). Unset entries keep neocfg's names; transforms still name features by neocfg's names."""

    label: Optional[str] = None
    # One stored column per dense feature of the model, in order.
    dense: Optional[List[str]] = None
    # Table name -> stored column: a list of ids per row, or one integer id per row.
    sparse: Dict[str, str] = field(default_factory=dict)
    # Table name -> stored column of per-id weights: a list of numbers per row as long as the row's id list (one
    # number per row for a one-id-per-row column). The table's bags pool sum(weight x row); unmapped tables weigh 1.
    weights: Dict[str, str] = field(default_factory=dict)
    # Unique integer per sample; null with no sample_id column stored: sample ids are row numbers in the dataset.
    sample_id: Optional[str] = None

    def check(self, key: str) -> None:
        if self.label is not None:
            checks.non_empty(f"{key}.label", self.label)
        for name, col in self.sparse.items():
            checks.non_empty(f"{key}.sparse.{name}", col)
        for name, col in self.weights.items():
            checks.non_empty(f"{key}.weights.{name}", col)


@dataclass
class DsiConfig:
    name: str = MISSING
    source: DataSource = DataSource.synthetic
    # Dataset directory for source=parquet (relative paths are taken from the directory neocfg was started in).
    path: Optional[str] = None
    # Which stored column holds each feature (datasets not written by neocfg).
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    # In a dataset without neocfg's manifest: the .parquet files held out for evaluation (an fnmatch pattern).
    eval_files: str = "eval*"
    # Files in a public format that mode=gen_data converts into `path` (instead of generating samples).
    raw: RawDataConfig = field(default_factory=RawDataConfig)
    # Distinct training samples: the dataset mode=gen_data writes, and the epoch of source=synthetic (the ranks read
    # samples 0..num_samples-1 in turn, then the same samples again in the same order; its held-out batches are
    # other samples). Then the files' shape (mode=gen_data).
    num_samples: int = 65536
    num_files: int = 4
    row_groups_per_file: int = 4
    # Extra stored columns the model does not read (projection must skip them): count and bytes per sample each.
    extra_columns: int = 8
    extra_column_bytes: int = 64
    seed: int = 1234
    # Synthetic source only: 0 streams new samples every step (learnable); N > 0 generates each rank's first N batches
    # once and cycles them (TorchRec's RandomRecDataset num_generated_batches): for timing the step alone.
    cycle_batches: int = 0
    # Held-out samples written by mode=gen_data into their own file (eval-00000.parquet), read by eval sources.
    eval_samples: int = 8192
    # Generated raw data: fraction of dense values missing (null) and of rows without a label (null).
    missing_fraction: float = 0.01
    unlabeled_fraction: float = 0.01
    # Preprocessing declared per feature column, applied in order by the DPP workers.
    transforms: List[TransformConfig] = field(default_factory=list)
    # DPP service: where workers run, split results buffered per trainer client, and the time limits after which
    # a split (worker busy on it) or a client (waiting for a batch) gives up.
    backend: DppBackendKind = DppBackendKind.local
    prefetch_splits: int = 4
    split_timeout_s: float = 60.0
    stall_timeout_s: float = 120.0
    # Online scaling: add a worker while clients stall, retire one when all are idle, between the planned count
    # divided and multiplied by autoscale_factor (and at most max_workers).
    autoscale: bool = False
    autoscale_factor: float = 4.0
    ray: RayConfig = field(default_factory=RayConfig)
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
        checks.positive(f"{key}.eval_samples", self.eval_samples)
        checks.non_negative(f"{key}.cycle_batches", self.cycle_batches)
        if self.cycle_batches and self.source is not DataSource.synthetic:
            raise ConfigError(f"{key}.cycle_batches", self.cycle_batches,
                              f"cycles pre-generated synthetic batches; dsi.source={self.source.value} streams its "
                              f"dataset (set dsi.cycle_batches=0)")
        checks.in_range(f"{key}.missing_fraction", self.missing_fraction, 0.0, 1.0, hi_open=True)
        checks.in_range(f"{key}.unlabeled_fraction", self.unlabeled_fraction, 0.0, 1.0, hi_open=True)
        for i, t in enumerate(self.transforms):
            t.check(f"{key}.transforms.{i}")
        self.columns.check(f"{key}.columns")
        self.raw.check(f"{key}.raw")
        checks.positive(f"{key}.prefetch_splits", self.prefetch_splits)
        checks.positive(f"{key}.split_timeout_s", self.split_timeout_s)
        checks.positive(f"{key}.stall_timeout_s", self.stall_timeout_s)
        if not (self.workers == "auto" or (isinstance(self.workers, int) and not isinstance(self.workers, bool)
                                           and self.workers > 0)):
            raise ConfigError(f"{key}.workers", self.workers, "must be 'auto' or a positive integer")
        checks.positive(f"{key}.max_workers", self.max_workers)
        checks.in_range(f"{key}.autoscale_factor", self.autoscale_factor, 1.0, 100.0)
        self.ray.check(f"{key}.ray")
        checks.positive(f"{key}.preprocess_cpu_us_per_sample", self.preprocess_cpu_us_per_sample)
        checks.positive(f"{key}.bytes_read_per_sample", self.bytes_read_per_sample)
        checks.positive(f"{key}.tensor_bytes_per_sample", self.tensor_bytes_per_sample)
        checks.non_empty(f"{key}.worker_shapes", self.worker_shapes)
        for i, shape in enumerate(self.worker_shapes):
            shape.check(f"{key}.worker_shapes.{i}")
        checks.unique(f"{key}.worker_shapes", [s.name for s in self.worker_shapes])
        checks.positive(f"{key}.trainer_ingest_gbs", self.trainer_ingest_gbs)
        checks.in_range(f"{key}.headroom", self.headroom, 0.0, 10.0)
