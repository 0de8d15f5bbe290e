"""A Parquet dataset on disk: column names, the manifest that mode=gen_data writes, and the splits DPP hands out.

Layout of `dsi.path`:
  part-00000.parquet ...   training samples, `dsi.row_groups_per_file` row groups each
  eval-00000.parquet       held-out samples (sample ids from EVAL_FIRST_SAMPLE on), read by eval sources only
  _manifest.json           files, row groups and rows per row group, seed and model (the DPP master reads only this)

A split is one row group of one file: the unit the master hands to a worker.

`dsi.path` may be a local directory (relative to where neocfg was started) or a URI that pyarrow.fs opens:
file:///data/ds, s3://bucket/ds (with pyarrow's query options, e.g. ?endpoint_override=host:9000&scheme=http),
gs://, hdfs://. Splits name their file by the same kind of URI, so a worker on any host opens the same file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from neocfg.config.dsi import ColumnsConfig
from neocfg.config.model import ModelConfig
from neocfg.errors import ConfigError, DataError

MANIFEST_NAME = "_manifest.json"
MANIFEST_FORMAT_VERSION = 1
LABEL_COLUMN = "label"
SAMPLE_ID_COLUMN = "sample_id"


def dense_column(j: int) -> str:
    return f"dense_{j}"


def sparse_column(table_name: str) -> str:
    return f"sparse_{table_name}"


def weight_column(sparse: str) -> str:
    """The per-id weights of a sparse column (sparse_<table> -> weight_<table>)."""
    return "weight_" + sparse[len("sparse_"):]


def extra_column(k: int) -> str:
    return f"extra_{k}"


@dataclass(frozen=True)
class FeatureColumns:
    """The columns one model reads, in Batch order: dense features, then one id list per table. Names are neocfg's
    (dense_<j>, sparse_<table>, label, sample_id); `stored` maps those a dataset stores under other names."""

    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    table_rows: tuple[int, ...]
    # (neocfg name, stored name) for each column stored under another name (dsi.columns).
    stored: tuple[tuple[str, str], ...] = ()
    # The sparse columns whose ids carry weights (dsi.columns.weights), each read from weight_column(name).
    weighted: tuple[str, ...] = ()

    @staticmethod
    def for_model(model: ModelConfig, mapping: Optional[ColumnsConfig] = None,
                  key: str = "dsi.columns") -> "FeatureColumns":
        cols = FeatureColumns(dense=tuple(dense_column(j) for j in range(model.num_dense_features)),
                              sparse=tuple(sparse_column(t.name) for t in model.tables),
                              table_rows=tuple(t.num_embeddings for t in model.tables))
        if mapping is None:
            return cols
        stored: dict[str, str] = {}
        if mapping.label is not None:
            stored[LABEL_COLUMN] = mapping.label
        if mapping.sample_id is not None:
            stored[SAMPLE_ID_COLUMN] = mapping.sample_id
        if mapping.dense is not None:
            if len(mapping.dense) != len(cols.dense):
                raise ConfigError(f"{key}.dense", list(mapping.dense), f"model {model.name} has "
                                  f"{len(cols.dense)} dense features: list one stored column for each, in order")
            stored.update(zip(cols.dense, mapping.dense))
        tables = [t.name for t in model.tables]
        for table, column in mapping.sparse.items():
            if table not in tables:
                raise ConfigError(f"{key}.sparse.{table}", column, f"model {model.name} has no table {table!r} "
                                  f"(its tables: {', '.join(tables[:8])}{', ...' if len(tables) > 8 else ''})")
            stored[sparse_column(table)] = column
        for table, column in mapping.weights.items():
            if table not in tables:
                raise ConfigError(f"{key}.weights.{table}", column, f"model {model.name} has no table {table!r} "
                                  f"(its tables: {', '.join(tables[:8])}{', ...' if len(tables) > 8 else ''})")
            stored[weight_column(sparse_column(table))] = column
        taken = [c for c in stored.values() if list(stored.values()).count(c) > 1]
        if taken:
            raise ConfigError(key, taken[0], "a stored column can feed only one feature")
        weighted = tuple(sparse_column(t) for t in tables if t in mapping.weights)
        return dataclasses.replace(cols, stored=tuple((k, v) for k, v in stored.items() if k != v), weighted=weighted)

    @property
    def projected(self) -> list[str]:
        """Every column a worker reads (the projection): features, weights, label and sample id, by neocfg's names."""
        return [*self.dense, *self.sparse, *map(weight_column, self.weighted), LABEL_COLUMN, SAMPLE_ID_COLUMN]

    def stored_name(self, name: str) -> str:
        return dict(self.stored).get(name, name)

    def read_columns(self, schema_names: Sequence[str]) -> list[str]:
        """The stored columns to read from a file with these columns: the projection, less the sample id when the
        file stores none (sample ids are then row numbers)."""
        return [self.stored_name(c) for c in self.projected
                if c != SAMPLE_ID_COLUMN or self.stored_name(c) in schema_names]

    def renamed(self, table: pa.Table) -> pa.Table:
        """A table read with read_columns(), its columns renamed to neocfg's names."""
        if not self.stored:
            return table
        back = {v: k for k, v in self.stored}
        return table.rename_columns([back.get(c, c) for c in table.column_names])


@dataclass(frozen=True)
class FileEntry:
    name: str
    eval: bool
    row_group_rows: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    model_name: str
    seed: int
    num_samples: int
    eval_samples: int
    files: tuple[FileEntry, ...]
    columns: tuple[str, ...]

    def save(self, directory: Path) -> None:
        d = {"format_version": MANIFEST_FORMAT_VERSION, **asdict(self)}
        (directory / MANIFEST_NAME).write_text(json.dumps(d, indent=1) + "\n")

    @staticmethod
    def load(directory: Union[str, Path]) -> "Manifest":
        path = join_location(directory, MANIFEST_NAME)
        try:
            fs, inner = open_location(path)
            with fs.open_input_stream(inner) as f:
                d = json.loads(f.read().decode())
            return Manifest(model_name=d["model_name"], seed=d["seed"], num_samples=d["num_samples"],
                            eval_samples=d["eval_samples"], columns=tuple(d["columns"]),
                            files=tuple(FileEntry(name=f["name"], eval=f["eval"],
                                                  row_group_rows=tuple(f["row_group_rows"])) for f in d["files"]))
        except FileNotFoundError:
            raise DataError(f"{directory}: no dataset here ({MANIFEST_NAME} missing); "
                            f"write one with `neocfg mode=gen_data dsi.path={directory}`") from None
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: cannot read ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc})"
                            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: not a valid neocfg dataset manifest ({type(exc).__name__}: {exc})") from None


# What dsi.source=parquet reads, for the one-line error about anything else.
SUPPORTED_FORMATS = ("a directory of Parquet files (*.parquet; neocfg's _manifest.json is optional)",
                     "one .parquet file",
                     "Criteo TSV (train.txt, day_N, day_N.gz) after `neocfg mode=gen_data dsi=criteo dsi.raw.files=[...]`")
PARQUET_SUFFIX = ".parquet"


def _format_error(location: str, what: str) -> DataError:
    return DataError(f"{location}: {what}; dsi.source=parquet reads " + "; ".join(SUPPORTED_FORMATS))


def index_parquet(location: str, eval_pattern: str) -> tuple[str, Manifest]:
    """A dataset without neocfg's manifest: the .parquet files at `location` (a directory, or one file), their row
    groups read from the footers; files whose name matches `eval_pattern` are the held-out ones. Anything else at
    `location` is a DataError listing the formats that are read."""
    fs, inner = open_location(location)
    try:
        info = fs.get_file_info(inner)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{location}: cannot read ({str(exc).strip().splitlines()[0]})") from None
    if info.type is pafs.FileType.NotFound:
        raise DataError(f"{location}: no dataset here (nothing at this path); write one with "
                        f"`neocfg mode=gen_data dsi.path={location}`")
    if info.type is pafs.FileType.File:
        if not info.base_name.endswith(PARQUET_SUFFIX):
            suffix = info.extension.upper() or "this file"
            raise _format_error(location, f"{suffix} is not a format neocfg trains from")
        directory, names = location[:len(location) - len(info.base_name)].rstrip("/") or ".", [info.base_name]
    else:
        listed = fs.get_file_info(pafs.FileSelector(inner, recursive=False))
        names = sorted(f.base_name for f in listed if f.type is pafs.FileType.File and f.base_name.endswith(
            PARQUET_SUFFIX) and not f.base_name.startswith((".", "_")))
        if not names:
            others = sorted({f.extension or f.base_name for f in listed if f.type is pafs.FileType.File})
            found = f"holds no .parquet files (found: {', '.join(others[:5])})" if others else "is empty"
            raise _format_error(location, found)
        directory = location
    files = []
    for name in names:
        path = join_location(directory, name)
        try:
            f_fs, f_inner = open_location(path)
            with f_fs.open_input_file(f_inner) as f:
                meta = pq.ParquetFile(f).metadata
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: not a readable Parquet file ({str(exc).strip().splitlines()[0]})") from None
        files.append(FileEntry(name=name, eval=fnmatch.fnmatchcase(name, eval_pattern),
                               row_group_rows=tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))))
        columns = tuple(meta.schema.to_arrow_schema().names)
    rows = {e: sum(sum(f.row_group_rows) for f in files if f.eval == e) for e in (False, True)}
    return directory, Manifest(model_name="", seed=0, num_samples=rows[False], eval_samples=rows[True],
                               files=tuple(files), columns=columns)


def open_dataset(location: str, eval_pattern: str) -> tuple[str, Manifest]:
    """(directory, manifest) of `dsi.path`: neocfg's manifest where there is one, else an index of its .parquet
    files (index_parquet)."""
    fs, inner = open_location(location)
    try:
        has_manifest = fs.get_file_info(join_location(inner, MANIFEST_NAME)).type is pafs.FileType.File
    except (OSError, pa.ArrowException):
        has_manifest = False
    return (location, Manifest.load(location)) if has_manifest else index_parquet(location, eval_pattern)


@dataclass(frozen=True)
class Split:
    """Row group `row_group` of `path`; `index` numbers the splits of one DPP service from 0."""

    index: int
    path: str
    row_group: int
    rows: int
    # Rows of the training (or eval) files before this split: sample ids when the dataset stores none.
    first_row: int = 0

    @property
    def where(self) -> str:
        return f"{self.path} split {self.index} (row group {self.row_group})"


def dataset_splits(directory: Union[str, Path], manifest: Manifest, *, eval: bool) -> list[Split]:
    """Every (file, row group) of the training (or the eval) files, in file order."""
    out: list[Split] = []
    first = 0
    for f in manifest.files:
        if f.eval != eval:
            continue
        for rg, rows in enumerate(f.row_group_rows):
            out.append(Split(index=len(out), path=join_location(directory, f.name), row_group=rg, rows=rows,
                             first_row=first))
            first += rows
    return out


def rank_splits(splits: list[Split], rank: int, world_size: int) -> list[Split]:
    """Rank r's share of the splits (every world_size-th), renumbered from 0; all splits if the share is empty."""
    mine = splits[rank::world_size] or splits
    return [dataclasses.replace(s, index=i) for i, s in enumerate(mine)]


def resolve_path(path: str) -> Path:
    """`dsi.path` taken from the directory neocfg was started in (not the per-run Hydra output directory)."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    try:
        from hydra.utils import get_original_cwd

        base = Path(get_original_cwd())
    except (ImportError, ValueError):  # not running under Hydra
        base = Path.cwd()
    return base / p


def is_uri(path: str) -> bool:
    return "://" in str(path)


def resolve_location(path: str) -> str:
    """`dsi.path` as workers anywhere open it: a URI unchanged, a local path made absolute (resolve_path)."""
    return path if is_uri(path) else str(resolve_path(path))


def join_location(location: Union[str, Path], name: str) -> str:
    """A file inside a dataset location; a URI's query options (?endpoint_override=...) stay at the end."""
    text = str(location)
    base, sep, query = text.partition("?") if is_uri(text) else (text, "", "")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def open_location(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI, and the path inside it."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), str(location)
    try:
        return pafs.FileSystem.from_uri(location)
    except (pa.ArrowException, ValueError) as exc:
        raise DataError(f"{location}: cannot open this location ({str(exc).strip().splitlines()[0]}); dsi.path may "
                        f"be a local directory or a URI pyarrow.fs knows (file://, s3://, gs://, hdfs://)") from None
