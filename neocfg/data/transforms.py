"""DPP preprocessing: the transforms declared per feature in `dsi.transforms`, applied to one split at a time.

A split's rows are held as numpy columns (float64 with NaN for a missing value; id lists as lengths + flat values)
and every step is a whole-column numpy operation, never a Python loop over rows:

  filter        rows whose value fails `cmp value` are dropped (a missing value fails every comparison)
  fill_missing  NaN -> value (dense, label); a missing id list is already empty
  clip_min      y = max(x, value) (NaN stays NaN)
  log           y = ln(max(x + offset, LOG_FLOOR))
  logit         y = ln(p / (1 - p)), p = clip(x, eps, 1 - eps)
  bucketize     y = number of boundaries <= x, as a float (NaN stays NaN)
  hash          id -> id mod num_embeddings of the column's table (modulo hashing, as DLRM's Criteo preprocessing)
  truncate      each list keeps its first max_ids ids
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from neocfg.config.dsi import TransformConfig
from neocfg.data.arrays import BatchArrays
from neocfg.data.dataset import LABEL_COLUMN, SAMPLE_ID_COLUMN, FeatureColumns, weight_column
from neocfg.errors import ConfigError, DataError
from neocfg.types import FilterCmp, TransformOp

# ln() input floor for the log transform: keeps log finite for x + offset <= 0 (ln(1e-12) ~ -27.6).
LOG_FLOOR = 1e-12
_SCALAR_OPS = (TransformOp.clip_min, TransformOp.log, TransformOp.logit, TransformOp.bucketize, TransformOp.filter)
_LIST_OPS = (TransformOp.hash, TransformOp.truncate)
_COMPARE = {
    FilterCmp.eq: np.equal, FilterCmp.ne: np.not_equal, FilterCmp.lt: np.less, FilterCmp.le: np.less_equal,
    FilterCmp.gt: np.greater, FilterCmp.ge: np.greater_equal,
}


@dataclass
class IdLists:
    lengths: np.ndarray  # [n] int64
    values: np.ndarray   # [sum(lengths)] int64
    weights: Optional[np.ndarray] = None  # [sum(lengths)] float32 per-id weights (dsi.columns.weights), or None


@dataclass
class SplitRows:
    """The rows of one split while they are being transformed."""

    scalars: dict[str, np.ndarray]  # dense_<j>, label: float64 (NaN = missing); sample_id: int64
    lists: dict[str, IdLists]       # sparse_<table>

    @property
    def rows(self) -> int:
        return int(self.scalars[SAMPLE_ID_COLUMN].shape[0])

    def select(self, mask: np.ndarray) -> None:
        for name, col in self.scalars.items():
            self.scalars[name] = col[mask]
        for lst in self.lists.values():
            keep = np.repeat(mask, lst.lengths)
            lst.values = lst.values[keep]
            if lst.weights is not None:
                lst.weights = lst.weights[keep]
            lst.lengths = lst.lengths[mask]


@dataclass(frozen=True)
class BoundTransform:
    """A transform resolved against the model's columns (patterns expanded, table sizes known)."""

    config: TransformConfig
    columns: tuple[str, ...]
    table_rows: tuple[int, ...]  # per column, for hash (0 for scalar columns)
    index: int = 0               # position in dsi.transforms (named in messages)

    @property
    def describe(self) -> str:
        t = self.config
        operand = "" if t.cmp is FilterCmp.not_null or t.value is None else f" {t.value:g}"
        return f"{t.op.value} {t.column} {t.cmp.value}{operand}" if t.op is TransformOp.filter else \
            f"{t.op.value} {t.column}"


def bind(transforms: list[TransformConfig], columns: FeatureColumns, key: str = "dsi.transforms"
         ) -> list[BoundTransform]:
    """Expand each column pattern over the model's columns and check that the op fits the column kind."""
    scalar_names = [*columns.dense, LABEL_COLUMN, SAMPLE_ID_COLUMN]
    rows_of = dict(zip(columns.sparse, columns.table_rows))
    bound = []
    for i, t in enumerate(transforms):
        names = [c for c in [*scalar_names, *columns.sparse] if fnmatch.fnmatchcase(c, t.column)]
        wrong = [c for c in names if (c in rows_of and t.op in _SCALAR_OPS) or (c not in rows_of and t.op in _LIST_OPS)]
        if wrong:
            kind = "a dense/label column" if t.op in _SCALAR_OPS else "a sparse id-list column"
            raise ConfigError(f"{key}.{i}.column", t.column, f"op {t.op.value} needs {kind}, but it matches {wrong[0]}")
        bound.append(BoundTransform(config=t, columns=tuple(names), table_rows=tuple(rows_of.get(c, 0) for c in names),
                                    index=i))
    return bound


def normalization_of(transforms: list[TransformConfig], column: str) -> TransformConfig | None:
    """The first log/logit declared for a column (mode=gen_data stores raw values this step normalizes)."""
    for t in transforms:
        if t.op in (TransformOp.log, TransformOp.logit) and fnmatch.fnmatchcase(column, t.column):
            return t
    return None


def hashed(transforms: list[TransformConfig], column: str) -> bool:
    return any(t.op is TransformOp.hash and fnmatch.fnmatchcase(column, t.column) for t in transforms)


def from_arrow(table: pa.Table, columns: FeatureColumns, where: str, first_row: int = 0) -> SplitRows:
    """Numpy columns of a projected table (neocfg's column names); a missing column or a wrong type is a DataError
    naming `where` and the stored column. Without a sample_id column, sample ids are first_row, first_row + 1, ...
    An id column may hold a list of ids per row or one integer id per row (a missing one: an empty list)."""
    names = set(table.column_names)
    for c in columns.projected:
        if c not in names and c != SAMPLE_ID_COLUMN:
            raise DataError(f"{where}: column {columns.stored_name(c)!r} is missing (the model needs it); the file's "
                            f"schema does not match the model (map stored columns to features with dsi.columns)")
    scalars = {}
    for c in [*columns.dense, LABEL_COLUMN]:
        col = table.column(c)
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise DataError(f"{where}: column {columns.stored_name(c)!r} has type {col.type}, expected a number")
        scalars[c] = pc.cast(col, pa.float64()).to_numpy()
    if SAMPLE_ID_COLUMN in names:
        sid = table.column(SAMPLE_ID_COLUMN)
        if not pa.types.is_integer(sid.type) or sid.null_count:
            raise DataError(f"{where}: column {columns.stored_name(SAMPLE_ID_COLUMN)!r} must be integers without "
                            f"nulls, got {sid.type}")
        scalars[SAMPLE_ID_COLUMN] = pc.cast(sid, pa.int64()).to_numpy()
    else:
        scalars[SAMPLE_ID_COLUMN] = np.arange(first_row, first_row + table.num_rows, dtype=np.int64)
    lists = {}
    for c in columns.sparse:
        col = table.column(c).combine_chunks()
        if pa.types.is_integer(col.type):
            lengths = col.is_valid().to_numpy(zero_copy_only=False).astype(np.int64)
            lists[c] = IdLists(lengths=lengths, values=pc.cast(col.drop_null(), pa.int64()).to_numpy())
            if c in columns.weighted:
                lists[c].weights = _weights_of(table, columns, c, lists[c], where, col.is_valid())
            continue
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) \
                or not pa.types.is_integer(col.type.value_type):
            raise DataError(f"{where}: column {columns.stored_name(c)!r} has type {col.type}, expected list<int64> "
                            f"or one integer id per row")
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
        values = pc.cast(col.flatten(), pa.int64())
        if values.null_count:
            raise DataError(f"{where}: column {columns.stored_name(c)!r} has null ids inside its lists")
        lists[c] = IdLists(lengths=lengths, values=values.to_numpy())
        if c in columns.weighted:
            lists[c].weights = _weights_of(table, columns, c, lists[c], where)
    return SplitRows(scalars=scalars, lists=lists)


def _weights_of(table: pa.Table, columns: FeatureColumns, sparse: str, ids: IdLists, where: str,
                has_id: Optional[pa.Array] = None) -> np.ndarray:
    """The per-id weights of a sparse column, float32 in id order: a list of numbers per row as long as the row's
    ids (one number per row where the ids are one integer per row, `has_id` marking the rows that have one). A
    mismatch, a missing weight or a non-finite one is a DataError naming both stored columns and the first bad
    row."""
    name = weight_column(sparse)
    col = table.column(name).combine_chunks()
    stored, ids_stored = columns.stored_name(name), columns.stored_name(sparse)
    if has_id is not None:   # one id per row: one weight per row that has an id
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise DataError(f"{where}: weights column {stored!r} has type {col.type}, expected one number per row "
                            f"(its ids column {ids_stored!r} holds one id per row)")
        lengths = col.is_valid().to_numpy(zero_copy_only=False).astype(np.int64)
        values = pc.cast(pc.filter(col, has_id), pa.float64())
    else:
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or not (
                pa.types.is_floating(col.type.value_type) or pa.types.is_integer(col.type.value_type)):
            raise DataError(f"{where}: weights column {stored!r} has type {col.type}, expected a list of numbers per "
                            f"row, as long as the row's ids in {ids_stored!r}")
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
        values = pc.cast(col.flatten(), pa.float64())
    bad = np.flatnonzero(lengths != ids.lengths) if has_id is None else np.flatnonzero(lengths < ids.lengths)
    if bad.size:
        r = int(bad[0])
        raise DataError(f"{where}: weights column {stored!r} has {int(lengths[r])} weights in row {r} of the split "
                        f"where {ids_stored!r} has {int(ids.lengths[r])} ids ({bad.size} rows differ); each id needs "
                        f"one weight")
    out = values.to_numpy(zero_copy_only=False).astype(np.float64)
    if values.null_count or not np.isfinite(out).all():
        raise DataError(f"{where}: weights column {stored!r} has missing or non-finite weights; every id needs a "
                        f"finite weight")
    return out.astype(np.float32)


def _filter_mask(x: np.ndarray, t: TransformConfig) -> np.ndarray:
    valid = ~np.isnan(x) if x.dtype.kind == "f" else np.ones(x.shape, dtype=bool)
    if t.cmp is FilterCmp.not_null:
        return valid
    return valid & _COMPARE[t.cmp](x, t.value)


def _scalar_step(x: np.ndarray, t: TransformConfig) -> np.ndarray:
    if t.op is TransformOp.fill_missing:
        return np.where(np.isnan(x), t.value, x) if x.dtype.kind == "f" else x
    if t.op is TransformOp.clip_min:
        return np.where(x < t.value, t.value, x)
    if t.op is TransformOp.log:
        return np.log(np.maximum(x + t.offset, LOG_FLOOR))
    if t.op is TransformOp.logit:
        p = np.clip(x, t.eps, 1.0 - t.eps)
        return np.log(p) - np.log1p(-p)
    if t.op is TransformOp.bucketize:
        b = np.searchsorted(np.asarray(t.boundaries, dtype=np.float64), x, side="right").astype(np.float64)
        return np.where(np.isnan(x), np.nan, b)
    raise AssertionError(t.op)


def _list_step(lst: IdLists, t: TransformConfig, table_rows: int) -> int:
    """Applies one list step in place; returns the ids it cut (truncate), else 0."""
    if t.op is TransformOp.hash:
        lst.values = np.mod(lst.values, table_rows)
    elif t.op is TransformOp.truncate:
        starts = np.repeat(np.cumsum(lst.lengths) - lst.lengths, lst.lengths)
        keep = (np.arange(lst.values.shape[0]) - starts) < t.max_ids
        cut = int(lst.values.shape[0] - keep.sum())
        lst.values = lst.values[keep]
        if lst.weights is not None:
            lst.weights = lst.weights[keep]
        lst.lengths = np.minimum(lst.lengths, t.max_ids)
        return cut
    # fill_missing: a missing list was read as an empty one already.
    return 0


def apply(rows: SplitRows, transforms: list[BoundTransform],
          dropped: Optional[dict[int, int]] = None, cut: Optional[dict[int, int]] = None) -> SplitRows:
    """Run the bound transforms in declared order, in place; returns rows for chaining. `dropped` (optional)
    collects the rows each filter removed, `cut` the ids each truncate removed, by transform index."""
    for bt in transforms:
        t = bt.config
        for name, table_rows in zip(bt.columns, bt.table_rows):
            if t.op is TransformOp.filter:
                before = rows.rows
                rows.select(_filter_mask(rows.scalars[name], t))
                if dropped is not None:
                    dropped[bt.index] = dropped.get(bt.index, 0) + before - rows.rows
            elif name in rows.lists:
                n = _list_step(rows.lists[name], t, table_rows)
                if n and cut is not None:
                    cut[bt.index] = cut.get(bt.index, 0) + n
            else:
                rows.scalars[name] = _scalar_step(rows.scalars[name], t)
    return rows


def to_batch_arrays(rows: SplitRows, columns: FeatureColumns, where: str) -> BatchArrays:
    """Batch layout, after checking what the model needs: no missing value left, ids inside each table."""
    for c in [*columns.dense, LABEL_COLUMN]:
        missing = int(np.isnan(rows.scalars[c]).sum())
        if missing:
            hint = "declare a filter (cmp: not_null) on it" if c == LABEL_COLUMN else "declare a fill_missing transform"
            raise DataError(f"{where}: column {columns.stored_name(c)!r} has {missing} missing values after the "
                            f"transforms; {hint}")
    for c, table_rows in zip(columns.sparse, columns.table_rows):
        v = rows.lists[c].values
        if v.size and (int(v.min()) < 0 or int(v.max()) >= table_rows):
            raise DataError(f"{where}: column {columns.stored_name(c)!r} has ids outside [0, {table_rows}) (min {int(v.min())}, max "
                            f"{int(v.max())}); declare a hash transform or fix the model's num_embeddings")
    n = rows.rows
    dense = (np.stack([rows.scalars[c] for c in columns.dense], axis=1) if columns.dense
             else np.zeros((n, 0))).astype(np.float32)
    lengths = (np.stack([rows.lists[c].lengths for c in columns.sparse]) if columns.sparse
               else np.zeros((0, n), dtype=np.int64))
    values = (np.concatenate([rows.lists[c].values for c in columns.sparse]) if columns.sparse
              else np.zeros(0, dtype=np.int64))
    weights = None
    if columns.weighted:   # one weight per id of every table; a table without weights weighs 1
        weights = np.concatenate([np.ones(rows.lists[c].values.shape[0], np.float32) if rows.lists[c].weights is None
                                  else rows.lists[c].weights for c in columns.sparse])
    return BatchArrays(dense=dense, lengths=lengths.astype(np.int64), values=values.astype(np.int64),
                       labels=rows.scalars[LABEL_COLUMN].astype(np.float32),
                       sample_ids=np.require(rows.scalars[SAMPLE_ID_COLUMN], requirements="W"), weights=weights)
