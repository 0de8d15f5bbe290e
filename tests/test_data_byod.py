"""Bring your own data: a Parquet dataset written by pyarrow with its own column names (no neocfg manifest, no
sample_id column, one integer id per row for one table and 40-id bags for another) trains through DPP, mapped to the
model's features by a dsi preset of the user's own (`--config-dir`), as a whole `mode=train` process; presets cut
no bags, a declared truncation is counted; an unsupported format (CSV) is one line listing the supported ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import compose_cfg
from neocfg.data.source import make_source
from neocfg.errors import ConfigError

DENSE = [f"f{j:02d}" for j in range(13)]
# dlrm_tiny's tables -> the user's columns: t0 holds one integer id per row, t1 bags of BAG ids, the rest lists.
SPARSE = {"t0": "user_id", "t1": "item_hist", **{f"t{k}": f"c{k}" for k in range(2, 8)}}
ROWS = {"part-a.parquet": 3000, "part-b.parquet": 2000, "eval.parquet": 1000}
BAG = 40
MAPPING = ["dsi=parquet_local", "dsi.path=mine", "++dsi.columns.label=click", f"++dsi.columns.dense=[{','.join(DENSE)}]",
           "++dsi.columns.sparse={" + ",".join(f"{k}:{v}" for k, v in SPARSE.items()) + "}",
           "dsi.transforms=[{column: 'sparse_*', op: hash}]"]


def _write(root: Path) -> Path:
    """The user's dataset: pyarrow.parquet.write_table, the user's names, row groups of 1000 rows."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name, n in ROWS.items():
        dense = rng.normal(size=(n, len(DENSE))).astype(np.float32)
        cols: dict[str, pa.Array] = {c: pa.array(dense[:, j]) for j, c in enumerate(DENSE)}
        user = rng.integers(0, 1 << 40, n)
        cols["user_id"] = pa.array(user)
        cols["item_hist"] = pa.ListArray.from_arrays(pa.array(np.arange(0, n * BAG + 1, BAG, dtype=np.int32)),
                                                     pa.array(rng.integers(0, 1 << 40, n * BAG)))
        for k in range(2, 8):
            lengths = rng.integers(0, 4, n)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            cols[f"c{k}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1 << 30, offsets[-1])))
        cols["click"] = pa.array((dense[:, 0] + (user % 7 == 0) > 0.5).astype(np.int8))
        cols["comment"] = pa.array(["unused"] * n)  # a column no feature maps to
        pq.write_table(pa.table(cols), root / name, row_group_size=1000)
    return root


def test_pyarrow_dataset_with_own_names_trains_through_dpp(cli, tmp_path):
    _write(tmp_path / "data" / "mine")
    conf = tmp_path / "myconf" / "dsi"
    conf.mkdir(parents=True)
    sparse = "\n".join(f"    {k}: {v}" for k, v in SPARSE.items())
    (conf / "mine.yaml").write_text(f"""name: mine
source: parquet
path: data/mine
eval_files: "eval*"
columns:
  label: click
  dense: [{', '.join(DENSE)}]
  sparse:
{sparse}
transforms:
  - {{column: "sparse_*", op: hash}}
""")
    r = cli("--config-dir", str(tmp_path / "myconf"), "mode=train", "dsi=mine", "train.steps=20",
            "train.batch_size=64", "train.eval_batches=2", "train.log_every=10", "planner.algorithm=greedy",
            timeout=600)
    assert r.returncode == 0, r.stderr
    assert "truncates" not in r.stdout
    m = json.loads(sorted((tmp_path / "outputs").rglob("metrics.json"))[-1].read_text())
    assert m["samples_delivered"] == 20 * 64 * 2 and m["duplicate_samples"] == 0
    assert m["data"]["dpp.ids_truncated"] == 0 and m["eval_auc"] is not None


def test_mapped_batches_keep_every_id_and_a_declared_truncation_is_counted(tmp_path, monkeypatch):
    _write(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg([*MAPPING, "dsi.workers=1", "train.batch_size=100"])
    src = make_source(cfg, 0, 1)
    try:
        b = src.next_batch()
        assert b.lengths.shape == (8, 100)
        assert (b.lengths[0] == 1).all() and (b.lengths[1] == BAG).all()   # one id per row; whole 40-id bags
        assert b.values.max() < 50000 and b.dense.shape == (100, 13)
        ids = {int(i) for i in b.sample_ids}                               # row numbers of the training files
        assert len(ids) == 100 and max(ids) < 5000
    finally:
        src.close()
    cut = compose_cfg([*MAPPING[:-1], "dsi.workers=1", "train.batch_size=100",
                       "dsi.transforms=[{column: 'sparse_*', op: hash}, {column: sparse_t1, op: truncate, max_ids: 16}]"])
    src = make_source(cut, 0, 1)
    try:
        assert (src.next_batch().lengths[1] == 16).all()
        assert src.stats()["dpp.ids_truncated"] >= 1000 * (BAG - 16)      # at least one whole row group cut
    finally:
        src.close()


def test_a_mapping_to_no_such_table_or_a_short_dense_list_is_refused():
    with pytest.raises(ConfigError, match=r"dsi\.columns\.sparse\.nope='x' is invalid: model dlrm_tiny has no "
                                          r"table 'nope'"):
        make_source(compose_cfg(["dsi=parquet_local", "dsi.path=x", "++dsi.columns.sparse={nope: x}"]), 0, 1)
    with pytest.raises(ConfigError, match=r"dsi\.columns\.dense=.*13 dense features"):
        make_source(compose_cfg(["dsi=parquet_local", "dsi.path=x", "++dsi.columns.dense=[a,b]"]), 0, 1)


@pytest.mark.parametrize("what", ["file", "directory"])
def test_csv_is_one_line_listing_the_supported_formats(cli, tmp_path, what):
    (tmp_path / "csvs").mkdir()
    path = tmp_path / "data.csv" if what == "file" else tmp_path / "csvs"
    (tmp_path / "csvs" / "a.csv").write_text("label,x\n1,2\n")
    (tmp_path / "data.csv").write_text("label,x\n1,2\n")
    r = cli("mode=train", "dsi=parquet_local", f"dsi.path={path}", "train.steps=2", "planner.algorithm=greedy")
    assert r.returncode == 4 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("neocfg: error:")]
    assert len(errors) == 1
    want = "CSV is not a format neocfg trains from" if what == "file" else "holds no .parquet files (found: csv)"
    assert want in errors[0] and "reads a directory of Parquet files" in errors[0] and "Criteo TSV" in errors[0]
