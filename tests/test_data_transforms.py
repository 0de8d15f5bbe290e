"""Every declared transform against hand-computed values, and the checks that guard the model's input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from neocfg.config.dsi import TransformConfig
from neocfg.data.dataset import FeatureColumns
from neocfg.data.transforms import LOG_FLOOR, IdLists, SplitRows, apply, bind, to_batch_arrays
from neocfg.errors import ConfigError, DataError
from neocfg.types import FilterCmp, TransformOp
from conftest import compose_cfg

NAN = float("nan")
COLS = FeatureColumns(dense=("dense_0", "dense_1"), sparse=("sparse_a", "sparse_b"), table_rows=(10, 1000))


def rows() -> SplitRows:
    return SplitRows(
        scalars={"dense_0": np.array([0.0, 1.0, NAN, 99.0]), "dense_1": np.array([0.5, NAN, 0.9, 0.0]),
                 "label": np.array([1.0, 0.0, NAN, 1.0]), "sample_id": np.array([10, 11, 12, 13])},
        lists={"sparse_a": IdLists(lengths=np.array([2, 0, 3, 1]), values=np.array([3, 14, 25, 7, 36, -1])),
               "sparse_b": IdLists(lengths=np.array([1, 1, 1, 1]), values=np.array([5, 6, 7, 8]))})


def run(*steps: TransformConfig) -> SplitRows:
    return apply(rows(), bind(list(steps), COLS))


def T(column: str, op: TransformOp, **kw) -> TransformConfig:
    return TransformConfig(column=column, op=op, **kw)


def test_log():
    out = run(T("dense_0", TransformOp.log, offset=1.0))
    np.testing.assert_allclose(out.scalars["dense_0"], [0.0, math.log(2.0), NAN, math.log(100.0)])
    out = run(T("dense_0", TransformOp.log, offset=-1.0))  # x + offset <= 0 -> floor
    np.testing.assert_allclose(out.scalars["dense_0"][[0, 1]], [math.log(LOG_FLOOR), math.log(LOG_FLOOR)])


def test_logit_clips():
    out = run(T("dense_1", TransformOp.logit, eps=0.01))
    np.testing.assert_allclose(out.scalars["dense_1"],
                               [0.0, NAN, math.log(0.9 / 0.1), math.log(0.01 / 0.99)], atol=1e-12)


def test_bucketize():
    out = run(T("dense_0", TransformOp.bucketize, boundaries=[0.0, 5.0, 100.0]))
    np.testing.assert_array_equal(out.scalars["dense_0"], [1.0, 1.0, NAN, 2.0])


def test_fill_missing_on_dense_and_label():
    out = run(T("dense_*", TransformOp.fill_missing, value=-7.0), T("label", TransformOp.fill_missing, value=0.0))
    np.testing.assert_array_equal(out.scalars["dense_0"], [0.0, 1.0, -7.0, 99.0])
    np.testing.assert_array_equal(out.scalars["dense_1"], [0.5, -7.0, 0.9, 0.0])
    np.testing.assert_array_equal(out.scalars["label"], [1.0, 0.0, 0.0, 1.0])


def test_hash_into_table_range():
    out = run(T("sparse_*", TransformOp.hash))
    np.testing.assert_array_equal(out.lists["sparse_a"].values, [3, 4, 5, 7, 6, 9])  # -1 mod 10 = 9
    np.testing.assert_array_equal(out.lists["sparse_b"].values, [5, 6, 7, 8])


def test_truncate_keeps_first_ids():
    out = run(T("sparse_a", TransformOp.truncate, max_ids=1))
    np.testing.assert_array_equal(out.lists["sparse_a"].lengths, [1, 0, 1, 1])
    np.testing.assert_array_equal(out.lists["sparse_a"].values, [3, 25, -1])


@pytest.mark.parametrize("cmp,value,kept", [
    (FilterCmp.not_null, None, [10, 11, 13]),
    (FilterCmp.ge, 1.0, [10, 13]),
    (FilterCmp.gt, 0.0, [10, 13]),
    (FilterCmp.lt, 1.0, [11]),
    (FilterCmp.le, 0.0, [11]),
    (FilterCmp.eq, 1.0, [10, 13]),
    (FilterCmp.ne, 1.0, [11]),  # a missing label fails every comparison, ne included
])
def test_filter_rows_on_label(cmp, value, kept):
    out = run(T("label", TransformOp.filter, cmp=cmp, value=value))
    np.testing.assert_array_equal(out.scalars["sample_id"], kept)
    # The id lists follow the rows they belong to.
    full = rows()
    want = [full.lists["sparse_a"].values[np.repeat(np.isin(full.scalars["sample_id"], kept),
                                                    full.lists["sparse_a"].lengths)]]
    np.testing.assert_array_equal(out.lists["sparse_a"].values, want[0])
    assert out.lists["sparse_a"].lengths.sum() == out.lists["sparse_a"].values.size


def test_filter_on_sample_id_range():
    out = run(T("sample_id", TransformOp.filter, cmp=FilterCmp.lt, value=12))
    np.testing.assert_array_equal(out.scalars["sample_id"], [10, 11])


def test_order_is_declared_order():
    # fill then log: the filled 0 goes through log; log then fill: the missing value becomes the fill value.
    a = run(T("dense_0", TransformOp.fill_missing, value=0.0), T("dense_0", TransformOp.log))
    b = run(T("dense_0", TransformOp.log), T("dense_0", TransformOp.fill_missing, value=5.0))
    assert a.scalars["dense_0"][2] == 0.0 and b.scalars["dense_0"][2] == 5.0


def test_to_batch_arrays_layout_and_checks():
    good = run(T("label", TransformOp.filter), T("dense_*", TransformOp.fill_missing, value=0.0),
               T("sparse_*", TransformOp.hash))
    b = to_batch_arrays(good, COLS, "f split 0")
    assert b.dense.shape == (3, 2) and b.dense.dtype == np.float32
    np.testing.assert_array_equal(b.lengths, [[2, 0, 1], [1, 1, 1]])
    np.testing.assert_array_equal(b.values, [3, 4, 9, 5, 6, 8])  # table-major
    np.testing.assert_array_equal(b.sample_ids, [10, 11, 13])
    with pytest.raises(DataError, match=r"f split 0: column 'dense_1' has 1 missing values.*fill_missing"):
        to_batch_arrays(run(T("label", TransformOp.filter, cmp=FilterCmp.ne, value=5.0)), COLS, "f split 0")
    with pytest.raises(DataError, match=r"'label' has 1 missing.*filter"):
        to_batch_arrays(run(T("dense_*", TransformOp.fill_missing, value=0.0)), COLS, "x")
    with pytest.raises(DataError, match=r"'sparse_a' has ids outside \[0, 10\).*hash"):
        to_batch_arrays(run(T("label", TransformOp.filter), T("dense_*", TransformOp.fill_missing, value=0.0)),
                        COLS, "x")


def test_bind_rejects_op_on_wrong_column_kind():
    with pytest.raises(ConfigError, match=r"dsi.transforms.0.column.*log needs a dense/label column.*sparse_a"):
        bind([T("sparse_a", TransformOp.log)], COLS)
    with pytest.raises(ConfigError, match=r"hash needs a sparse id-list column.*dense_0"):
        bind([T("dense_0", TransformOp.hash)], COLS)
    assert bind([T("nothing_*", TransformOp.log)], COLS)[0].columns == ()  # a pattern may match nothing


@pytest.mark.parametrize("override,expected", [
    ("dsi.transforms=[{column: dense_0, op: bucketize, boundaries: [2.0, 1.0]}]", "strictly increasing"),
    ("dsi.transforms=[{column: sparse_t0, op: truncate}]", "max_ids"),
    ("dsi.transforms=[{column: dense_0, op: fill_missing}]", "needs a value"),
    ("dsi.transforms=[{column: label, op: filter, cmp: gt}]", "needs a value"),
    ("dsi.transforms=[{column: dense_0, op: logit, eps: 0.7}]", "dsi.transforms.0.eps"),
    ("dsi.transforms=[{column: dense_0, op: explode}]", "explode"),
])
def test_transform_config_errors(override, expected):
    with pytest.raises(Exception, match=expected):
        compose_cfg(["dsi=parquet_local", override])


def test_vectorized_on_a_large_split_is_fast():
    import time

    n = 200_000
    rng = np.random.default_rng(0)
    big = SplitRows(scalars={"dense_0": rng.random(n) * 100, "dense_1": rng.random(n), "label": rng.random(n).round(),
                             "sample_id": np.arange(n)},
                    lists={"sparse_a": IdLists(np.full(n, 4), rng.integers(0, 10**9, 4 * n)),
                           "sparse_b": IdLists(np.ones(n, dtype=np.int64), rng.integers(0, 10**9, n))})
    steps = bind([T("label", TransformOp.filter, cmp=FilterCmp.eq, value=1.0), T("dense_0", TransformOp.log),
                  T("dense_1", TransformOp.logit), T("sparse_*", TransformOp.hash),
                  T("sparse_a", TransformOp.truncate, max_ids=2)], COLS)
    t0 = time.perf_counter()
    out = apply(big, steps)
    assert time.perf_counter() - t0 < 1.0  # ~200k rows; a per-row Python loop would take seconds
    assert out.lists["sparse_a"].values.size == 2 * out.rows
