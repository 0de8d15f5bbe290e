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

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

import pyarrow as pa
import pyarrow.fs as pafs

from neocfg.config.model import ModelConfig
from neocfg.errors import DataError

MANIFEST_NAME = "_manifest.json"
MANIFEST_FORMAT_VERSION = 1
LABEL_COLUMN = "label"
SAMPLE_ID_COLUMN = "sample_id"


def dense_column(j: int) -> str:
    return f"dense_{j}"


def sparse_column(table_name: str) -> str:
    return f"sparse_{table_name}"


def extra_column(k: int) -> str:
    return f"extra_{k}"


@dataclass(frozen=True)
class FeatureColumns:
    """The columns one model reads, in Batch order: dense features, then one id list per table."""

    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    table_rows: tuple[int, ...]

    @staticmethod
    def for_model(model: ModelConfig) -> "FeatureColumns":
        return FeatureColumns(dense=tuple(dense_column(j) for j in range(model.num_dense_features)),
                              sparse=tuple(sparse_column(t.name) for t in model.tables),
                              table_rows=tuple(t.num_embeddings for t in model.tables))

    @property
    def projected(self) -> list[str]:
        """Every column a worker reads (the projection): features, label and sample id."""
        return [*self.dense, *self.sparse, LABEL_COLUMN, SAMPLE_ID_COLUMN]


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


@dataclass(frozen=True)
class Split:
    """Row group `row_group` of `path`; `index` numbers the splits of one DPP service from 0."""

    index: int
    path: str
    row_group: int
    rows: int

    @property
    def where(self) -> str:
        return f"{self.path} split {self.index} (row group {self.row_group})"


def dataset_splits(directory: Union[str, Path], manifest: Manifest, *, eval: bool) -> list[Split]:
    """Every (file, row group) of the training (or the eval) files, in file order."""
    out: list[Split] = []
    for f in manifest.files:
        if f.eval != eval:
            continue
        for rg, rows in enumerate(f.row_group_rows):
            out.append(Split(index=len(out), path=join_location(directory, f.name), row_group=rg, rows=rows))
    return out


def rank_splits(splits: list[Split], rank: int, world_size: int) -> list[Split]:
    """Rank r's share of the splits (every world_size-th), renumbered from 0; all splits if the share is empty."""
    mine = splits[rank::world_size] or splits
    return [Split(index=i, path=s.path, row_group=s.row_group, rows=s.rows) for i, s in enumerate(mine)]


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
