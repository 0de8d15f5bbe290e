"""mode=gen_data: write a Parquet dataset for the chosen model into `dsi.path`, generated, or converted from files in
a public format when dsi.raw.format is set (neocfg/data/criteo.py).

Content comes from SyntheticData (Zipf-skewed ids with each table's pooling factor, a label from a hidden function of
the features), stored *raw*, the way logs hold it, so that the declared transforms have real work to do:
  dense_<j>       float32; exp(z) - offset where a log is declared, sigmoid(z) where a logit is, else z;
                  `missing_fraction` of the values null
  sparse_<table>  list<int64>; raw 64-bit-style ids id + num_embeddings * k where a hash is declared
  label           float32 in {0, 1}; `unlabeled_fraction` of the rows null (a declared filter drops them)
  sample_id       int64, unique (training 0..num_samples-1, held-out from EVAL_FIRST_SAMPLE on)
  extra_<k>       fixed-size random bytes the model never reads (projection skips them)

The directory is built under a temporary name next to the target and renamed into place at the end, so a failed or
interrupted run leaves nothing half-written; an existing neocfg dataset at the target is replaced.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from neocfg.config.dsi import TransformConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.data.dataset import (LABEL_COLUMN, MANIFEST_NAME, SAMPLE_ID_COLUMN, FeatureColumns, FileEntry, Manifest,
                                 extra_column, is_uri, resolve_path)
from neocfg.data.source import EVAL_FIRST_SAMPLE
from neocfg.data.synthetic import SyntheticData
from neocfg.data.transforms import bind, hashed, normalization_of
from neocfg.errors import ConfigError, DataError
from neocfg.types import RawFormat, TransformOp
from neocfg.units import fmt_bytes

# Raw ids are id + num_embeddings * k with k < RAW_ID_SPREAD: out of every table's range, like hashed log ids.
RAW_ID_SPREAD = 1 << 20
# Seed stream of the raw encoding (missing values, raw-id spread, extra bytes), apart from SyntheticData's streams.
_RAW_STREAM = 7


@dataclass(frozen=True)
class GenReport:
    path: str
    train_samples: int
    eval_samples: int
    files: int
    row_groups: int
    total_bytes: int
    model_column_bytes: int

    @property
    def model_fraction(self) -> float:
        return self.model_column_bytes / max(self.total_bytes, 1)


@dataclass(frozen=True)
class _FilePlan:
    name: str
    eval: bool
    first_sample: int
    row_group_rows: tuple[int, ...]


def _file_plans(cfg: NeocfgConfig) -> list[_FilePlan]:
    d = cfg.dsi
    plans, start = [], 0
    for f, file_rows in enumerate(np.array_split(np.arange(d.num_samples), d.num_files)):
        rgs = tuple(len(r) for r in np.array_split(file_rows, d.row_groups_per_file) if len(r))
        plans.append(_FilePlan(f"part-{f:05d}.parquet", False, start, rgs))
        start += len(file_rows)
    eval_rgs = tuple(len(r) for r in np.array_split(np.arange(d.eval_samples), d.row_groups_per_file) if len(r))
    plans.append(_FilePlan("eval-00000.parquet", True, EVAL_FIRST_SAMPLE, eval_rgs))
    return [p for p in plans if p.row_group_rows]


def _raw_dense(z: np.ndarray, step: TransformConfig | None) -> np.ndarray:
    """The raw value that `step` maps back to z."""
    if step is None:
        return z
    if step.op is TransformOp.log:
        return np.exp(z) - step.offset
    return 1.0 / (1.0 + np.exp(-z))  # logit


def _row_group(cfg: NeocfgConfig, data: SyntheticData, start: int, n: int) -> pa.Table:
    d, cols = cfg.dsi, FeatureColumns.for_model(cfg.model)
    a = data.arrays(start, n)
    rng = np.random.default_rng([d.seed, _RAW_STREAM, start])
    out: dict[str, pa.Array] = {}
    missing = rng.random(a["dense"].shape) < d.missing_fraction
    for j, name in enumerate(cols.dense):
        raw = _raw_dense(a["dense"][:, j].astype(np.float64), normalization_of(d.transforms, name)).astype(np.float32)
        out[name] = pa.array(raw, mask=missing[:, j])
    offset = 0
    for t, (name, rows) in enumerate(zip(cols.sparse, cols.table_rows)):
        lengths = a["lengths"][t]
        ids = a["values"][offset:offset + int(lengths.sum())]
        offset += int(lengths.sum())
        if hashed(d.transforms, name):
            ids = ids + rows * rng.integers(0, RAW_ID_SPREAD, ids.shape[0])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, type=pa.int64()))
    out[LABEL_COLUMN] = pa.array(a["labels"], mask=rng.random(n) < d.unlabeled_fraction)
    out[SAMPLE_ID_COLUMN] = pa.array(a["sample_ids"])
    for k in range(d.extra_columns if d.extra_column_bytes else 0):
        buf = pa.py_buffer(rng.bytes(n * d.extra_column_bytes))
        out[extra_column(k)] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(d.extra_column_bytes), n, [None, buf])
    return pa.table(out)


def _write(cfg: NeocfgConfig, tmp: Path, plans: list[_FilePlan]) -> Manifest:
    data = SyntheticData.for_model(cfg.model, cfg.dsi.seed)
    columns: tuple[str, ...] = ()
    with tqdm(total=sum(len(p.row_group_rows) for p in plans), desc="gen_data", unit="row group") as bar:
        for p in plans:
            writer, start = None, p.first_sample
            for n in p.row_group_rows:
                with np.errstate(over="ignore"):  # the synthetic hashes multiply wrapping integers
                    table = _row_group(cfg, data, start, n)
                if writer is None:
                    writer = pq.ParquetWriter(tmp / p.name, table.schema)
                    columns = tuple(table.column_names)
                writer.write_table(table, row_group_size=n)
                start += n
                bar.update(1)
            writer.close()
    return Manifest(model_name=cfg.model.name, seed=cfg.dsi.seed, num_samples=cfg.dsi.num_samples,
                    eval_samples=cfg.dsi.eval_samples, columns=columns,
                    files=tuple(FileEntry(p.name, p.eval, p.row_group_rows) for p in plans))


def _measure(path: Path, manifest: Manifest, needed: list[str]) -> tuple[int, int]:
    """(bytes of all files, bytes of the column chunks the model reads)."""
    total = model = 0
    for f in manifest.files:
        total += (path / f.name).stat().st_size
        meta = pq.ParquetFile(path / f.name).metadata
        for rg in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                col = meta.row_group(rg).column(c)
                if col.path_in_schema.split(".")[0] in needed:
                    model += col.total_compressed_size
    return total, model


def _replace(target: Path, tmp: Path) -> None:
    if target.exists():
        if not (target / MANIFEST_NAME).exists() and any(target.iterdir()):
            raise DataError(f"{target}: exists and is not a neocfg dataset; refusing to overwrite it")
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def write_dataset(cfg: NeocfgConfig) -> GenReport:
    if not cfg.dsi.path:
        raise ConfigError("dsi.path", None, "mode=gen_data needs a dataset directory (e.g. dsi=parquet_local)")
    bind(cfg.dsi.transforms, FeatureColumns.for_model(cfg.model))  # a transform on the wrong kind of column fails here
    path = cfg.dsi.path
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif is_uri(path):
        raise ConfigError("dsi.path", path, "mode=gen_data writes a local directory (or file://); write it locally, "
                          "then copy it to the store (e.g. pyarrow.fs.copy_files) and train with dsi.path=<the URI>")
    target = resolve_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if cfg.dsi.raw.format is RawFormat.criteo:
            from neocfg.data.criteo import convert

            manifest, _ = convert(cfg, tmp)
        else:
            manifest = _write(cfg, tmp, _file_plans(cfg))
        manifest.save(tmp)
        _replace(target, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total, model = _measure(target, manifest, FeatureColumns.for_model(cfg.model).projected)
    return GenReport(path=str(target), train_samples=manifest.num_samples, eval_samples=manifest.eval_samples,
                     files=len(manifest.files), row_groups=sum(len(f.row_group_rows) for f in manifest.files),
                     total_bytes=total, model_column_bytes=model)


def run(cfg: NeocfgConfig, run_dir: Path | None) -> GenReport:
    r = write_dataset(cfg)
    made = f" converted from {cfg.dsi.raw.format.value} files" if cfg.dsi.raw.format is not RawFormat.none else ""
    print(f"wrote {r.train_samples:,} training + {r.eval_samples:,} held-out samples{made} for model {cfg.model.name} to "
          f"{r.path}: {r.files} files, {r.row_groups} row groups, {fmt_bytes(r.total_bytes)}; the model's columns are "
          f"{fmt_bytes(r.model_column_bytes)} ({100 * r.model_fraction:.0f}% of the stored bytes)")
    return r
