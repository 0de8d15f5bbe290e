"""Criteo's public click logs, streamed into neocfg's Parquet dataset (mode=gen_data with dsi.raw.format=criteo).

Both public Criteo datasets share one line format: a label, 13 integer features and 26 categorical features written
as hexadecimal ids, tab-separated; an empty field is a missing value.
  Kaggle Display Advertising Challenge   train.txt (test.txt has no label column and is not read)
  Criteo 1TB Click Logs                  day_0 ... day_23, plain or gzipped (gzip is recognized by its magic bytes)

Decoding is TorchRec's (torchrec.datasets.criteo: the TSV reader and BinaryCriteoUtils), preprocessing DLRM's:
  label      0 or 1 (a missing label is 0)
  dense_<j>  the j-th integer feature, stored raw (missing: null); the `criteo` dsi preset's DPP transforms fill a
             missing value with 0, set negatives to 0 and take ln(x + 1)
  sparse_<t> one id per row, int(hex, 16) (missing: 0). categorical=hash stores it raw and DPP's hash transform takes
             it modulo the table's rows; categorical=vocabulary stores its row in a frequency-thresholded vocabulary
             built in a first pass over every converted row (TorchRec's sparse_to_contiguous): 1 for ids seen fewer
             than frequency_threshold times, 2, 3, ... for the others in order of first appearance
  sample_id  row number (training from 0, held-out from EVAL_FIRST_SAMPLE)

Input is read block by block by pyarrow's streaming CSV reader and row groups are written as they fill, so memory
holds a few blocks, the held-out tail (dsi.eval_samples rows) and, with a vocabulary, the vocabulary: a 1TB day file
is never in memory.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from tqdm import tqdm

from neocfg.config.schema import NeocfgConfig
from neocfg.data.dataset import LABEL_COLUMN, SAMPLE_ID_COLUMN, FeatureColumns, FileEntry, Manifest, resolve_path
from neocfg.data.source import EVAL_FIRST_SAMPLE
from neocfg.errors import ConfigError, DataError
from neocfg.types import CategoricalEncoding

# Criteo's line format (TorchRec's INT_FEATURE_COUNT, CAT_FEATURE_COUNT).
INT_FEATURES = 13
CAT_FEATURES = 26
# Text per block of pyarrow's streaming CSV reader: 8 MiB is about 35k Criteo lines of ~230 bytes.
READ_BLOCK_BYTES = 8 << 20
# int64 holds at most 16 hex digits (and only values below 2**63).
MAX_HEX_DIGITS = 16
_GZIP_MAGIC = b"\x1f\x8b"
_LABEL, _INTS, _CATS = "label", [f"int_{j}" for j in range(INT_FEATURES)], [f"cat_{k}" for k in range(CAT_FEATURES)]
_NIBBLE = np.full(256, 16, dtype=np.uint64)  # 16: not a hexadecimal digit
_NIBBLE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint64)
_NIBBLE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint64)


@dataclass
class CriteoBlock:
    """Consecutive lines of one file, decoded."""

    labels: np.ndarray       # [n] float32, 0 or 1
    dense: list[pa.Array]    # INT_FEATURES int64 arrays, null where missing
    cats: np.ndarray         # [n, CAT_FEATURES] int64, int(hex, 16); 0 where missing

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])


def parse_hex(arr: pa.Array, where: str) -> np.ndarray:
    """int(s, 16) of every string of `arr` (an empty or null string: 0), vectorized over its bytes."""
    n = len(arr)
    arr = arr.cast(pa.string())
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, np.int32)[arr.offset:arr.offset + n + 1].astype(np.int64)
    lengths = np.diff(offsets)
    if arr.null_count:
        lengths[~arr.is_valid().to_numpy(zero_copy_only=False)] = 0
    width = int(lengths.max()) if n else 0
    if width == 0:
        return np.zeros(n, np.int64)
    if width > MAX_HEX_DIGITS:
        row = int(np.argmax(lengths))
        raise DataError(f"{where}: categorical value {arr[row].as_py()!r} has more than {MAX_HEX_DIGITS} hex digits")
    data = np.frombuffer(data_buf, np.uint8)
    ends = offsets[:-1] + lengths
    idx = ends[:, None] - width + np.arange(width)           # right-aligned digit positions
    valid = idx >= offsets[:-1, None]
    nibbles = _NIBBLE[data[np.where(valid, idx, 0)]]
    nibbles[~valid] = 0
    bad = (nibbles == 16).any(axis=1)
    if bad.any():
        row = int(np.argmax(bad))
        raise DataError(f"{where}: categorical value {arr[row].as_py()!r} is not hexadecimal")
    values = np.bitwise_or.reduce(nibbles << (4 * np.arange(width - 1, -1, -1, dtype=np.uint64)), axis=1)
    if (values >= np.uint64(1 << 63)).any():
        raise DataError(f"{where}: a categorical value is above 7fffffffffffffff (int64)")
    return values.astype(np.int64)


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def expand(patterns: list[str], key: str) -> list[Path]:
    """Files of dsi.raw.files (taken from where neocfg was started); a glob's matches in natural order."""
    out: list[Path] = []
    for i, pattern in enumerate(patterns):
        path = resolve_path(pattern)
        matches = sorted(glob.glob(str(path)), key=_natural) if glob.has_magic(str(path)) else \
            ([str(path)] if path.is_file() else [])
        if not matches:
            raise ConfigError(f"{key}.{i}", pattern, f"no such file ({path})")
        out.extend(Path(m) for m in matches)
    return out


def read_blocks(path: Path, block_bytes: int = READ_BLOCK_BYTES) -> Iterator[CriteoBlock]:
    """Decoded blocks of one Criteo file, streamed (plain or gzip)."""
    with open(path, "rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
    where = str(path)
    names = [_LABEL, *_INTS, *_CATS]
    types = {_LABEL: pa.int64(), **{c: pa.int64() for c in _INTS}, **{c: pa.string() for c in _CATS}}
    try:
        stream = pa.input_stream(str(path), compression="gzip" if gz else None)
        reader = pacsv.open_csv(
            stream, read_options=pacsv.ReadOptions(column_names=names, block_size=block_bytes, use_threads=False),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False),
            convert_options=pacsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False))
        for batch in reader:
            yield CriteoBlock(labels=batch.column(0).fill_null(0).to_numpy().astype(np.float32),
                              dense=[batch.column(1 + j) for j in range(INT_FEATURES)],
                              cats=np.stack([parse_hex(batch.column(1 + INT_FEATURES + k), where)
                                             for k in range(CAT_FEATURES)], axis=1))
    except pa.ArrowInvalid as exc:
        first = str(exc).strip().splitlines()[0]
        raise DataError(f"{where}: not in Criteo's format ({first}); expected 40 tab-separated fields per line: "
                        f"label, 13 integers, 26 hex ids (Kaggle's test.txt has no label and cannot train)") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{where}: cannot read ({str(exc).strip().splitlines()[0]})") from None


def _rows_of(paths: list[Path], limit: Optional[int], desc: str) -> Iterator[CriteoBlock]:
    """Blocks of the files in order, at most `limit` rows in all."""
    seen = 0
    with tqdm(desc=desc, unit=" rows", unit_scale=True) as bar:
        for path in paths:
            for block in read_blocks(path):
                if limit is not None and seen + block.rows > limit:
                    keep = limit - seen
                    block = CriteoBlock(labels=block.labels[:keep], dense=[d.slice(0, keep) for d in block.dense],
                                        cats=block.cats[:keep])
                seen += block.rows
                bar.update(block.rows)
                if block.rows:
                    yield block
                if limit is not None and seen >= limit:
                    return


class Vocabulary:
    """Per categorical column, the ids seen, how often and where first (pass 1); then each id's row (TorchRec's
    sparse_to_contiguous: ids seen fewer than `threshold` times -> 1, the others -> 2, 3, ... by first appearance).
    Partial counts are merged like a binary counter (the last two while the older is at most twice the newer), so
    building costs O(N log N) whatever the number of blocks."""

    def __init__(self, columns: int, threshold: int) -> None:
        self.threshold = threshold
        self._parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(columns)]
        self._seen = 0
        self._keys: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []

    def add(self, cats: np.ndarray) -> None:
        for k, parts in enumerate(self._parts):
            keys, first, counts = np.unique(cats[:, k], return_index=True, return_counts=True)
            parts.append((keys, first.astype(np.int64) + self._seen, counts.astype(np.int64)))
            while len(parts) >= 2 and parts[-2][0].size <= 2 * parts[-1][0].size:
                parts.append(_merge(parts.pop(), parts.pop()))
        self._seen += cats.shape[0]

    def finish(self) -> None:
        for parts in self._parts:
            while len(parts) >= 2:
                parts.append(_merge(parts.pop(), parts.pop()))
            keys, first, counts = parts[0] if parts else (np.zeros(0, np.int64),) * 3
            frequent = np.flatnonzero(counts >= self.threshold)
            rows = np.ones(keys.shape[0], np.int64)
            rows[frequent[np.argsort(first[frequent], kind="stable")]] = 2 + np.arange(frequent.size)
            self._keys.append(keys)
            self._rows.append(rows)
        self._parts = []

    @property
    def sizes(self) -> list[int]:
        """Rows each column's ids need: 0 (unused) and 1 (rare ids), then one per frequent id."""
        return [int(r.max(initial=1)) + 1 for r in self._rows]

    def lookup(self, cats: np.ndarray) -> np.ndarray:
        out = np.empty_like(cats)
        for k, (keys, rows) in enumerate(zip(self._keys, self._rows)):
            out[:, k] = rows[np.searchsorted(keys, cats[:, k])]
        return out


def _merge(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys, first, counts = (np.concatenate([x, y]) for x, y in zip(a, b))
    order = np.argsort(keys, kind="stable")
    keys, first, counts = keys[order], first[order], counts[order]
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return keys[starts], np.minimum.reduceat(first, starts), np.add.reduceat(counts, starts)


class _SplitWriter:
    """Row groups of `row_group_rows`, `per_file` to a file, written as rows arrive; the last `hold` rows are kept
    back (the held-out tail)."""

    def __init__(self, directory: Path, prefix: str, row_group_rows: int, per_file: int, first_sample: int,
                 hold: int = 0) -> None:
        self.directory, self.prefix, self.rg_rows, self.per_file = directory, prefix, row_group_rows, per_file
        self.hold, self.next_sample = hold, first_sample
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.files: list[FileEntry] = []
        self._writer: Optional[pq.ParquetWriter] = None
        self._groups: list[int] = []

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        while self.pending_rows - self.hold >= self.rg_rows:
            self._emit(self._take(self.rg_rows))

    def _take(self, n: int) -> pa.Table:
        whole = pa.concat_tables(self.pending)
        self.pending = [whole.slice(n)] if n < whole.num_rows else []
        self.pending_rows -= n
        return whole.slice(0, n)

    def _emit(self, table: pa.Table) -> None:
        n = table.num_rows
        table = table.append_column(SAMPLE_ID_COLUMN, pa.array(np.arange(self.next_sample, self.next_sample + n)))
        self.next_sample += n
        if self._writer is None:
            name = f"{self.prefix}-{len(self.files):05d}.parquet"
            self._writer = pq.ParquetWriter(self.directory / name, table.schema)
            self.files.append(FileEntry(name=name, eval=self.prefix == "eval", row_group_rows=()))
        self._writer.write_table(table, row_group_size=n)
        self._groups.append(n)
        if len(self._groups) == self.per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            last = self.files[-1]
            self.files[-1] = FileEntry(name=last.name, eval=last.eval, row_group_rows=tuple(self._groups))
            self._writer, self._groups = None, []

    def finish(self) -> Optional[pa.Table]:
        """Writes what is left but the held-back tail, and returns that tail (None when nothing is held back)."""
        rest = self.pending_rows - self.hold
        while rest > 0:
            self._emit(self._take(min(rest, self.rg_rows)))
            rest = self.pending_rows - self.hold
        self._close_file()
        return pa.concat_tables(self.pending) if self.pending else None

    @property
    def rows(self) -> int:
        return sum(sum(f.row_group_rows) for f in self.files)


def _table(block: CriteoBlock, cols: FeatureColumns, ids: np.ndarray) -> pa.Table:
    offsets = pa.array(np.arange(block.rows + 1, dtype=np.int32))
    out: dict[str, pa.Array] = dict(zip(cols.dense, block.dense))
    for k, name in enumerate(cols.sparse):
        out[name] = pa.ListArray.from_arrays(offsets, pa.array(ids[:, k]))
    out[LABEL_COLUMN] = pa.array(block.labels)
    return pa.table(out)


@dataclass(frozen=True)
class CriteoReport:
    vocabulary_sizes: tuple[int, ...]  # empty with categorical=hash


def convert(cfg: NeocfgConfig, directory: Path) -> tuple[Manifest, CriteoReport]:
    """Converts dsi.raw.files (and eval_files) into neocfg's dataset layout in `directory`."""
    raw, model = cfg.dsi.raw, cfg.model
    if model.num_dense_features != INT_FEATURES or len(model.tables) != CAT_FEATURES:
        raise ConfigError("model", model.name, f"dsi.raw.format=criteo feeds {INT_FEATURES} dense features and "
                          f"{CAT_FEATURES} tables (this model: {model.num_dense_features} and {len(model.tables)}); "
                          f"use model=criteo_kaggle, criteo_tb_mlperf_v1 or dcnv2_mlperf")
    files = expand(list(raw.files), "dsi.raw.files")
    eval_files = expand(list(raw.eval_files), "dsi.raw.eval_files")
    cols = FeatureColumns.for_model(model)
    hold = 0 if eval_files else cfg.dsi.eval_samples

    def training() -> Iterator[CriteoBlock]:
        return _rows_of(files, raw.max_rows, "criteo: reading")

    def held_out() -> Iterator[CriteoBlock]:
        return _rows_of(eval_files, cfg.dsi.eval_samples, "criteo: held-out")

    vocab: Optional[Vocabulary] = None
    if raw.categorical is CategoricalEncoding.vocabulary:
        vocab = Vocabulary(CAT_FEATURES, raw.frequency_threshold)
        for block in _chain(training(), held_out() if eval_files else iter(())):
            vocab.add(block.cats)
        vocab.finish()
        for t, (table, size) in enumerate(zip(model.tables, vocab.sizes)):
            if size > table.num_embeddings:
                raise ConfigError(f"model.tables.{t}.num_embeddings", table.num_embeddings,
                                  f"table {table.name} needs {size:,} rows for the vocabulary of categorical column {t} at "
                                  f"dsi.raw.frequency_threshold={raw.frequency_threshold}: raise num_embeddings to "
                                  f"{size:,}, raise the threshold, or use dsi.raw.categorical=hash")

    def encoded(block: CriteoBlock) -> pa.Table:
        return _table(block, cols, vocab.lookup(block.cats) if vocab is not None else block.cats)

    train = _SplitWriter(directory, "part", raw.row_group_rows, cfg.dsi.row_groups_per_file, 0, hold=hold)
    for block in training():
        train.add(encoded(block))
    tail = train.finish()
    if train.rows == 0:
        raise ConfigError("dsi.eval_samples", cfg.dsi.eval_samples,
                          f"dsi.raw.files hold {tail.num_rows if tail is not None else 0:,} rows, none left for "
                          f"training after the held-out tail: lower it, or give dsi.raw.eval_files")
    held = _SplitWriter(directory, "eval", raw.row_group_rows, 1 << 30, EVAL_FIRST_SAMPLE)
    if tail is not None:
        held.add(tail)
    for block in held_out() if eval_files else ():
        held.add(encoded(block))
    held.finish()
    if vocab is not None:
        print(f"criteo: vocabulary rows per table at frequency_threshold={raw.frequency_threshold}: "
              f"{', '.join(f'{t.name} {n:,}' for t, n in zip(model.tables, vocab.sizes))}")
    columns = tuple(pq.read_schema(directory / train.files[0].name).names)
    manifest = Manifest(model_name=model.name, seed=cfg.dsi.seed, num_samples=train.rows, eval_samples=held.rows,
                        files=tuple([*train.files, *held.files]), columns=columns)
    return manifest, CriteoReport(vocabulary_sizes=tuple(vocab.sizes) if vocab is not None else ())


def _chain(*its: Iterator[CriteoBlock]) -> Iterator[CriteoBlock]:
    for it in its:
        yield from it
