"""Per-id weights from a user's Parquet (dsi.columns.weights): a list of numbers per row beside each id list (one
number per row beside a one-id-per-row column) reaches the batch beside its ids through DPP (filters and
truncations keep them paired), pools as fbgemm's per_sample_weights (a bag checked by hand), travels with its ids
to the ranks that own them (a whole `mode=train` on the Ray backend: a table whose weights are all 0 never moves
from its initial rows, and moves without them), and a weight list that does not match its ids, or a missing weight
column, is one line naming the column and the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import compose_cfg
from neocfg.data.source import make_source
from neocfg.errors import DataError
from neocfg.runtime.init_weights import init_rows

DENSE = [f"f{j:02d}" for j in range(13)]
SPARSE = {"t0": "user", "t1": "hist", **{f"t{k}": f"c{k}" for k in range(2, 8)}}
ROWS = {"part-a.parquet": 1200, "part-b.parquet": 800, "eval.parquet": 400}
ROW_GROUP = 400
MAX_BAG = 6


def _weight_of(ids: np.ndarray) -> np.ndarray:
    """The weights this dataset stores: a function of the id, so that a batch shows whether each id kept its own."""
    return (0.5 + (ids % 7) * 0.25).astype(np.float32)


def _write(root: Path, hist_weights=_weight_of, short_row: int | None = None) -> None:
    """The user's dataset (pyarrow, the user's names): t0 one id per row with a weight per row, t1 bags of 0..5 ids
    with a weight list each (hist_weights of the ids; short_row: that row's list one weight short), the rest one
    id per row, unweighted; some labels null."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name, n in ROWS.items():
        cols: dict[str, pa.Array] = {c: pa.array(rng.normal(size=n).astype(np.float32)) for c in DENSE}
        user = rng.integers(0, 1000, n)                      # dlrm_tiny t0: 1,000 rows
        cols["user"], cols["user_w"] = pa.array(user), pa.array(_weight_of(user))
        lengths = rng.integers(0, MAX_BAG, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        hist = rng.integers(0, 5000, offsets[-1])            # t1: 5,000 rows
        w = hist_weights(hist)
        w_offsets = offsets.copy()
        if short_row is not None:
            row = int(np.flatnonzero(lengths)[short_row])
            w = np.delete(w, offsets[row])
            w_offsets[row + 1:] -= 1
        cols["hist"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(hist))
        cols["hist_w"] = pa.ListArray.from_arrays(pa.array(w_offsets), pa.array(w))
        for k in range(2, 8):
            cols[f"c{k}"] = pa.array(rng.integers(0, 100, n))
        label = (cols["f00"].to_numpy() > 0).astype(np.float32)
        cols["click"] = pa.array(label, mask=rng.random(n) < 0.05)
        pq.write_table(pa.table(cols), root / name, row_group_size=ROW_GROUP)


UNWEIGHTED = ["dsi=parquet_local", "dsi.path=mine", "++dsi.columns.label=click",
              f"++dsi.columns.dense=[{','.join(DENSE)}]",
              "++dsi.columns.sparse={" + ",".join(f"{k}:{v}" for k, v in SPARSE.items()) + "}", "dsi.workers=1"]
MAPPING = [*UNWEIGHTED, "++dsi.columns.weights={t0: user_w, t1: hist_w}"]
FILTER = "{column: label, op: filter}"


def _table(batch, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of table t."""
    per = batch.lengths.sum(dim=1)
    a = int(per[:t].sum())
    return batch.values[a:a + int(per[t])], batch.weights[a:a + int(per[t])]


@pytest.mark.parametrize("truncate", [False, True])
def test_weights_reach_the_batch_beside_their_ids(tmp_path, monkeypatch, truncate):
    _write(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    cut = ", {column: sparse_t1, op: truncate, max_ids: 2}" if truncate else ""
    cfg = compose_cfg([*MAPPING, "train.batch_size=256", f"dsi.transforms=[{FILTER}{cut}]"])
    src = make_source(cfg, 0, 1)
    try:
        for _ in range(3):   # batches that cross row groups (the client joins pieces)
            b = src.next_batch()
            assert b.weights is not None and b.weights.dtype == torch.float32
            assert b.weights.shape == b.values.shape
            for t in (0, 1):
                ids, w = _table(b, t)
                assert torch.equal(w, torch.from_numpy(_weight_of(ids.numpy()))), t
            assert (b.lengths[1] <= (2 if truncate else MAX_BAG - 1)).all() and b.lengths[1].max() > 1
            for t in range(2, 8):
                assert (_table(b, t)[1] == 1).all()        # an unweighted table weighs 1
    finally:
        src.close()
    plain = make_source(compose_cfg([*UNWEIGHTED, "train.batch_size=256", f"dsi.transforms=[{FILTER}]"]), 0, 1)
    try:
        assert plain.next_batch().weights is None         # no weights mapped: unweighted batches, as before
    finally:
        plain.close()


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_weighted_bag_pools_the_weighted_sum_of_its_rows(tmp_path, monkeypatch, one_rank_gloo):
    """One batch from the user's files through DPP and the embeddings of every sharding kind (one rank): each
    table's pooled output is sum(weight x initial row) over the bag, computed here row by row."""
    import torch.distributed as dist

    from neocfg.runtime.dist import Comm
    from neocfg.runtime.embedding import ShardedEmbeddings
    from neocfg.runtime.layout import build_layout
    from neocfg.runtime.plans import rule_plan
    from neocfg.runtime.routing import RwEncoding
    from neocfg.runtime.timing import Stopwatch
    from neocfg.types import ShardingType as S

    _write(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    b_size = 32
    cfg = compose_cfg([*MAPPING, f"train.batch_size={b_size}", f"dsi.transforms=[{FILTER}]"])
    kinds = [S.data_parallel, S.row_wise, S.column_wise, S.table_wise, S.table_row_wise, S.table_column_wise,
             S.table_wise, S.row_wise]
    plan = rule_plan(cfg.model, world=1, devices_per_node=1, batch_size=b_size,
                     sharding={t.name: s for t, s in zip(cfg.model.tables, kinds)})
    for encoding in RwEncoding:
        emb = ShardedEmbeddings(build_layout(plan, cfg.model, 0), Comm(one_rank_gloo, 0, 1), cfg.train, b_size,
                                plan.a2a_fwd_dtype, plan.a2a_bwd_dtype, torch.device("cpu"),
                                Stopwatch(torch.device("cpu")), seed=3, dp_group=dist.new_group(),
                                encoding=encoding, id_dtype=torch.int32)
        src = make_source(cfg, 0, 1)
        try:
            batch = src.next_batch()
        finally:
            src.close()
        with torch.no_grad():
            got = emb(batch)
        col = 0
        for t, table in enumerate(cfg.model.tables):
            rows = init_rows(3, t, table.num_embeddings, table.embedding_dim, 0, table.num_embeddings)
            ids, w = _table(batch, t)
            want = torch.stack([(w_bag[:, None] * rows[i_bag]).sum(dim=0) for i_bag, w_bag in
                                zip(ids.split(batch.lengths[t].tolist()), w.split(batch.lengths[t].tolist()))])
            torch.testing.assert_close(got[:, col:col + table.embedding_dim], want, rtol=1e-5, atol=1e-6)
            col += table.embedding_dim
        assert not torch.equal(batch.weights, torch.ones_like(batch.weights))   # the weights were not all 1


def _shard(ckpt: Path, table: int) -> list[torch.Tensor]:
    """Table `table`'s rows in the last checkpoint, per shard (every rank's)."""
    last = sorted(ckpt.glob("step_*"))[-1]
    return [s for r in (0, 1) for s in torch.load(last / f"rank_{r}.pt", weights_only=False)["embeddings"]
            if s["table"] == table]


def test_zero_weights_keep_a_table_out_of_training(cli, tmp_path):
    """Whole `mode=train` runs on 2 ranks from the user's files, t1 row-wise (its ids routed to both ranks) and t0
    data-parallel: with t1's weights all 0 (through Ray's DPP) t1 ends on its initial rows while the weighted t0
    moved; the same files without the weight mapping train t1."""
    _write(tmp_path / "mine", hist_weights=lambda ids: np.zeros(ids.shape, np.float32))
    common = [*UNWEIGHTED, f"dsi.transforms=[{FILTER}]", "train.steps=6", "train.batch_size=64",
              "train.eval_batches=1", "train.checkpoint_every=6", "planner.algorithm=greedy",
              "model.tables.1.sharding_types=[row_wise]", "model.tables.0.sharding_types=[data_parallel]"]
    runs = {}
    for name, extra in {"weighted": [MAPPING[-1], "dsi.backend=ray"], "unweighted": []}.items():
        r = cli(*common, *extra, f"train.checkpoint_dir={tmp_path / name}", timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = tmp_path / name
    cfg = compose_cfg([])
    t0, t1 = cfg.model.tables[0], cfg.model.tables[1]
    hist = _shard(runs["weighted"], 1)
    assert len(hist) == 2                                        # row-wise over both ranks
    for s in hist:
        assert torch.equal(s["weights"], init_rows(cfg.train.seed, 1, t1.num_embeddings, t1.embedding_dim,
                                                   s["row_offset"], s["weights"].shape[0]))
    user = _shard(runs["weighted"], 0)
    assert not torch.equal(user[0]["weights"], init_rows(cfg.train.seed, 0, t0.num_embeddings, t0.embedding_dim, 0,
                                                         t0.num_embeddings))
    moved = [s for s in _shard(runs["unweighted"], 1) if not torch.equal(s["weights"], init_rows(
        cfg.train.seed, 1, t1.num_embeddings, t1.embedding_dim, s["row_offset"], s["weights"].shape[0]))]
    assert len(moved) == 2


def test_a_weight_list_that_does_not_match_its_ids_is_one_line(cli, tmp_path):
    _write(tmp_path / "mine", short_row=3)
    r = cli(*MAPPING, f"dsi.transforms=[{FILTER}]", "train.steps=2", "train.batch_size=64",
            "planner.algorithm=greedy", timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("neocfg: error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    assert ".parquet split" in errors[0] and "weights column 'hist_w' has" in errors[0], errors[0]
    assert "where 'hist' has" in errors[0] and "each id needs one weight" in errors[0]


def test_a_missing_weight_column_or_table_is_refused(tmp_path, monkeypatch):
    from neocfg.errors import ConfigError

    _write(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg([*UNWEIGHTED, "++dsi.columns.weights={t1: hist_weight}", "train.batch_size=64",
                       f"dsi.transforms=[{FILTER}]"])
    src = make_source(cfg, 0, 1)
    try:
        with pytest.raises(DataError, match=r"part-a\.parquet.*column 'hist_weight' is missing"):
            src.next_batch()
    finally:
        src.close()
    with pytest.raises(ConfigError, match=r"dsi\.columns\.weights\.nope='w' is invalid: model dlrm_tiny has no table"):
        make_source(compose_cfg(["dsi=parquet_local", "dsi.path=x", "++dsi.columns.weights={nope: w}"]), 0, 1)
