"""Mode=gen_data writes a Parquet dataset (through the real CLI) whose content the transforms turn back
into the learnable synthetic features."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neocfg.data import parquet_gen
from neocfg.data.dataset import MANIFEST_NAME, FeatureColumns, Manifest, dataset_splits
from neocfg.data.dpp.progress import Task
from neocfg.data.dpp.worker import SplitReader, WorkerSpec
from neocfg.data.source import EVAL_FIRST_SAMPLE
from neocfg.data.synthetic import SyntheticData
from neocfg.data.transforms import bind
from neocfg.errors import DataError
from data_helpers import make_dataset, small_cfg


def test_gen_data_cli_writes_dataset_relative_to_start_dir(cli, tmp_path):
    r = cli("mode=gen_data", "dsi=parquet_local", "dsi.path=mydata", "dsi.num_samples=3000", "dsi.eval_samples=500",
            "dsi.num_files=3", "dsi.row_groups_per_file=2")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "mydata"
    assert "wrote 3,000 training + 500 held-out samples" in r.stdout and str(out) in r.stdout
    assert "gen_data" in r.stderr  # tqdm progress
    assert not list((tmp_path / "outputs").rglob("*.parquet"))  # not in the Hydra run directory
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST_NAME, "eval-00000.parquet", "part-00000.parquet", "part-00001.parquet",
                     "part-00002.parquet"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mydata")]  # no temp dir left
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert sum(sum(f["row_group_rows"]) for f in manifest["files"] if not f["eval"]) == 3000

    pf = pq.ParquetFile(out / "part-00000.parquet")
    assert pf.num_row_groups == 2
    schema = pf.schema_arrow
    assert schema.field("sparse_t0").type == pa.list_(pa.int64())
    assert schema.field("dense_0").type == pa.float32() and schema.field("sample_id").type == pa.int64()
    assert len([n for n in schema.names if n.startswith("extra_")]) == 8
    ids = np.concatenate([pq.read_table(out / f, columns=["sample_id"])["sample_id"].to_numpy()
                          for f in names if f.endswith(".parquet")])
    assert len(np.unique(ids)) == len(ids) == 3500
    assert (ids[ids >= EVAL_FIRST_SAMPLE].size == 500)
    # Most stored bytes are columns the model never reads.
    assert "of the stored bytes" in r.stdout
    frac = int(r.stdout.split("(")[-1].split("%")[0])
    assert frac < 50


def test_gen_data_needs_a_path(cli):
    r = cli("mode=gen_data")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "dsi.path=None is invalid" in r.stderr


def test_stored_raw_values_need_the_transforms_and_come_back_as_the_synthetic_features(tmp_path):
    cfg = make_dataset(tmp_path / "ds")
    directory = tmp_path / "ds"
    raw = pq.read_table(directory / "part-00000.parquet")
    # Raw: dense_0 log-normal counts, dense_6 rates in (0, 1), ids far outside the tables, some nulls.
    d0 = raw["dense_0"].to_numpy(zero_copy_only=False)
    assert np.nanmin(d0) > -1.0 and np.isnan(d0).any()
    d6 = raw["dense_6"].to_numpy(zero_copy_only=False)
    assert np.nanmin(d6) > 0 and np.nanmax(d6) < 1
    assert pa.compute.max(raw["sparse_t0"].combine_chunks().flatten()).as_py() >= 1000
    assert raw["label"].null_count > 0

    cols = FeatureColumns.for_model(cfg.model)
    reader = SplitReader(WorkerSpec(columns=cols, transforms=tuple(bind(cfg.dsi.transforms, cols)), batch_size=10**6))
    split = dataset_splits(directory, Manifest.load(directory), eval=False)[1]
    out = reader.process(Task(epoch=0, split=split)).pieces[0].arrays
    with np.errstate(over="ignore"):  # SyntheticData hashes with wrapping uint64 products
        truth = SyntheticData.for_model(cfg.model, cfg.dsi.seed).arrays(int(out.sample_ids[0]), split.rows)
    pos = out.sample_ids - truth["sample_ids"][0]
    # log/logit columns come back as the synthetic N(0, 1) features (missing ones filled with 0).
    for j in (0, 3, 6, 9, 11):
        got, want = out.dense[:, j], truth["dense"][pos, j]
        ok = got != 0
        np.testing.assert_allclose(got[ok], want[ok], atol=2e-4)
        assert (~ok).mean() < 0.05
    assert set(np.unique(out.dense[:, 12])) <= {0.0, 1.0, 2.0, 3.0}  # bucketized
    np.testing.assert_array_equal(out.labels, truth["labels"][pos])
    # Hashing recovers the synthetic ids exactly (lengths <= 16 so truncation keeps them all here).
    lengths = truth["lengths"][:, pos]
    assert (lengths <= 16).all()
    np.testing.assert_array_equal(out.lengths, lengths)
    for t in range(len(cfg.model.tables)):
        tv = out.values[out.lengths[:t].sum():out.lengths[:t + 1].sum()]
        offs = np.concatenate([[0], np.cumsum(truth["lengths"][t])])
        all_t = truth["values"][truth["lengths"][:t].sum():truth["lengths"][:t + 1].sum()]
        want = np.concatenate([all_t[offs[i]:offs[i + 1]] for i in pos])
        np.testing.assert_array_equal(tv, want)


def test_failed_generation_leaves_nothing(tmp_path, monkeypatch):
    cfg = small_cfg(tmp_path / "ds")
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("disk full")
        return real(*args)

    real = parquet_gen._row_group
    monkeypatch.setattr(parquet_gen, "_row_group", broken)
    with pytest.raises(RuntimeError):
        parquet_gen.write_dataset(cfg)
    assert list(tmp_path.iterdir()) == []


def test_regenerating_replaces_a_dataset_but_never_a_foreign_directory(tmp_path):
    make_dataset(tmp_path / "ds")
    make_dataset(tmp_path / "ds", "dsi.num_samples=4000")
    assert Manifest.load(tmp_path / "ds").num_samples == 4000
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a neocfg dataset"):
        make_dataset(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
