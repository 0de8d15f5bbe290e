"""Data faults through the real CLI: a filter that keeps no row, or a rank whose every split is filtered
empty, fails in bounded time with one line naming the filter (no hang, no traceback); a capped dsi.workers, a batch
larger than the dataset and skipped bad splits are said on the console."""

from __future__ import annotations

import time

import pytest

from neocfg.types import Mode

pytestmark = pytest.mark.skipif(not hasattr(Mode, "train"), reason="mode=train (the runtime) is not in this build")

# No unlabeled rows: the tests below replace transforms.0 (the preset's not_null filter on label), and a rank that
# met a missing label would fail first with that error instead of the one under test.
DATA = ["mode=gen_data", "dsi=parquet_local", "dsi.path=ds", "dsi.unlabeled_fraction=0", "dsi.num_samples=4000",
        "dsi.eval_samples=500", "dsi.num_files=2", "dsi.row_groups_per_file=1"]
TRAIN = ["mode=train", "dsi=parquet_local", "dsi.path=ds", "train.steps=3", "train.batch_size=64",
         "train.eval_batches=0", "planner.algorithm=greedy", "dsi.workers=2"]


def _one_line_error(r) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("neocfg: error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_filter_that_keeps_nothing_fails_fast_naming_it(cli):
    assert cli(*DATA).returncode == 0
    t0 = time.monotonic()
    # label > 5 holds for no row (labels are 0/1): before, the workers spun on empty splits forever.
    r = cli(*TRAIN, "dsi.transforms.0.cmp=gt", "dsi.transforms.0.value=5", timeout=300)
    line = _one_line_error(r)
    assert time.monotonic() - t0 < 120
    assert "no sample left after the transforms" in line and "dsi.transforms.0 (filter label gt 5)" in line, line

    # Rank 1's only split (file 1: samples 2000..3999) is filtered empty, rank 0's is not.
    r = cli(*TRAIN, "dsi.transforms.0.column=sample_id", "dsi.transforms.0.cmp=lt", "dsi.transforms.0.value=2000",
            timeout=300)
    line = _one_line_error(r)
    assert "in this rank's 1 splits" in line and "dsi.transforms.0 (filter sample_id lt 2000)" in line, line


def test_capped_workers_big_batches_and_skipped_splits_are_said(cli, tmp_path):
    assert cli(*DATA[:-2], "dsi.num_files=4", "dsi.row_groups_per_file=1").returncode == 0
    (tmp_path / "ds" / "part-00001.parquet").write_bytes(b"not parquet" * 100)
    r = cli("mode=train", "dsi=parquet_local", "dsi.path=ds", "train.steps=2", "train.batch_size=2048",
            "train.eval_batches=1", "planner.algorithm=greedy", "dsi.workers=10", "dsi.max_workers=2",
            "dsi.on_bad_split=skip", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("warning: dsi.workers=10 asks for 5 worker processes per rank (10 over 2 ranks); capped at "
                     "dsi.max_workers=2") == 1, out
    assert "warning: train.batch_size=2048 x 2 ranks = 4,096 samples per step is more than the dataset's 4,000 " \
           "training samples" in out, out
    assert "warning: held-out evaluation reads 4,096 samples" in out and "the eval file has 500" in out, out
    assert "warning: skipped a bad split (dsi.on_bad_split=skip):" in out and "part-00001.parquet" in out, out
