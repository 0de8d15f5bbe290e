"""The vectorized synthetic generator (all tables in one draw) and the background Prefetcher."""

from __future__ import annotations

import dataclasses
import math
import os
import threading

import numpy as np
import pytest

from neocfg.data.arrays import BatchArrays
from neocfg.data.source import Prefetcher, SyntheticSource
from neocfg.data.synthetic import (CHUNK_SIZE, FLOAT_SCATTER_ROWS, ID_BLOCK, SyntheticData, _BlockBagSums, _LengthLaw,
                                   _scatter_constants, _scatter_float, scatter_ranks, zipf_ids)

DATA = SyntheticData(num_dense=3, rows=(100, 1000, 50, 7), pooling=(1.0, 3.5, 0.3, 2.0),
                     alphas=(1.0, 0.8, 1.3, 1.05), seed=5)


def test_any_range_equals_the_same_samples_of_a_longer_range():
    whole = DATA.batch_arrays(0, 3 * CHUNK_SIZE)
    for start, count in [(5, 17), (CHUNK_SIZE - 3, 10), (CHUNK_SIZE - 1, CHUNK_SIZE + 2), (0, CHUNK_SIZE)]:
        part = DATA.batch_arrays(start, count)
        want = whole.slice(start, start + count)
        for name in ("dense", "lengths", "values", "labels", "sample_ids"):
            np.testing.assert_array_equal(getattr(part, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(whole.sample_ids, np.arange(3 * CHUNK_SIZE))


def test_slice_and_concat_keep_each_tables_ids_with_its_samples():
    a = DATA.batch_arrays(0, 40)
    pieces = a.split_batches(13)
    back = BatchArrays.concat(pieces)
    np.testing.assert_array_equal(back.values, a.values)
    # table t's ids of sample i, found by walking the layout by hand
    bounds = np.concatenate([[0], np.cumsum(a.lengths.sum(axis=1))])
    for t in range(a.lengths.shape[0]):
        offs = bounds[t] + np.concatenate([[0], np.cumsum(a.lengths[t])])
        p = pieces[1]
        pb = np.concatenate([[0], np.cumsum(p.lengths.sum(axis=1))])
        po = pb[t] + np.concatenate([[0], np.cumsum(p.lengths[t])])
        for i in range(p.rows):
            np.testing.assert_array_equal(p.values[po[i]:po[i + 1]], a.values[offs[13 + i]:offs[14 + i]])


def test_each_table_keeps_its_own_pooling_rows_and_skew():
    a = DATA.batch_arrays(0, 8 * CHUNK_SIZE)
    n = a.rows
    per_table = a.lengths.sum(axis=1)
    bounds = np.concatenate([[0], np.cumsum(per_table)])
    for t, (rows, pool, alpha) in enumerate(zip(DATA.rows, DATA.pooling, DATA.alphas)):
        assert per_table[t] / n == pytest.approx(pool, rel=0.05)
        ids = a.values[bounds[t]:bounds[t + 1]]
        assert ids.min() >= 0 and ids.max() < rows
        # The hottest rank lands on scatter_ranks(0); P(rank 1) = P(continuous rank < 2) under this table's alpha.
        e = 1.0 - alpha
        p1 = np.log(2) / np.log(rows + 1) if abs(e) < 1e-9 else (2**e - 1) / ((rows + 1) ** e - 1)
        freq = float(np.mean(ids == scatter_ranks(0, rows, t)))
        sigma = np.sqrt(p1 * (1 - p1) / ids.size)
        assert abs(freq - p1) < 4 * sigma + 1e-3, (t, freq, p1)


@pytest.mark.parametrize("lengths", [[2, 0, 3, 0], [0, 0, 1], [0, 0], [4], [0, 5, 0, 0, 1]])
def test_bag_sums_add_each_bags_values_and_empty_bags_are_zero(lengths):
    lengths = np.array(lengths, np.int64)
    values = np.arange(1, lengths.sum() + 1, dtype=np.float32) ** 2
    want = [float(values[s:s + n].sum()) for s, n in zip(np.cumsum(lengths) - lengths, lengths)]
    bags = _BlockBagSums(lengths)
    bags.add(0, values)
    np.testing.assert_array_equal(bags.sums(), want)


def test_id_scores_are_uniform_independent_per_table_and_the_same_in_both_forms():
    ids = np.arange(200_000, dtype=np.int64) * 7
    a, b = DATA.id_score(0, ids), DATA.id_score(1, ids)
    assert a.min() >= -1 and a.max() < 1
    assert abs(float(a.mean())) < 0.01 and float(a.std()) == pytest.approx(1 / math.sqrt(3), rel=0.01)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01            # each table hides its own scores
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.01   # neighbouring ids unrelated
    tables = np.array([1, 0, 1, 1])
    np.testing.assert_array_equal(DATA.id_score(tables, ids[:4], salts=DATA._tables.salts),
                                  np.where(tables == 1, b[:4], a[:4]))


def test_ids_drawn_block_by_block_follow_each_tables_law_across_blocks():
    # two tables whose ids straddle block boundaries: every id of a table within its rows, uniform table even
    rows, counts = np.array([10, 1000]), np.array([ID_BLOCK + 7, 2 * ID_BLOCK])
    ids = zipf_ids(np.random.default_rng(3), rows, np.array([0.0, 1.2]), counts)
    first, second = ids[:counts[0]], ids[counts[0]:]
    assert first.max() < 10 and second.max() < 1000 and ids.min() >= 0
    assert np.bincount(first, minlength=10).min() > 0.8 * counts[0] / 10   # uniform over 10 rows
    hot = np.bincount(second, minlength=1000)
    assert hot.argmax() == scatter_ranks(0, 1000, 1) and hot.max() > 0.1 * counts[1]


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.0, 1.3])
def test_ids_follow_the_zipf_law_rank_by_rank(alpha):
    """P(rank <= r) = ((r + 1)^e - 1) / ((rows + 1)^e - 1), e = 1 - alpha (log(r + 1) / log(rows + 1) at alpha 1,
    r / rows uniform), for the hottest ranks one by one and the colder half, each row mapped back to its rank."""
    rows, n = 1000, 400_000
    ids = zipf_ids(np.random.default_rng(11), rows, alpha, n, tables=[4])
    rank_of_row = np.empty(rows, np.int64)
    rank_of_row[scatter_ranks(np.arange(rows), rows, 4)] = np.arange(1, rows + 1)
    ranks = rank_of_row[ids]
    e = 1.0 - alpha
    if alpha == 0.0:
        cdf = lambda r: r / rows   # noqa: E731
    elif abs(e) < 1e-9:
        cdf = lambda r: np.log(r + 1.0) / np.log(rows + 1.0)   # noqa: E731
    else:
        cdf = lambda r: ((r + 1.0) ** e - 1) / ((rows + 1.0) ** e - 1)   # noqa: E731
    for lo, hi in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 10), (rows // 2, rows)]:
        p = cdf(hi) - cdf(lo)
        got = float(np.mean((ranks > lo) & (ranks <= hi)))
        assert abs(got - p) < 5 * np.sqrt(p * (1 - p) / n), (alpha, lo, hi, got, p)


def test_one_table_draw_has_the_scalar_laws_shape():
    ids = zipf_ids(np.random.default_rng(0), 10, 1.0, 200_000)
    counts = np.bincount(ids, minlength=10)
    assert ids.min() >= 0 and ids.max() < 10 and counts[scatter_ranks(0, 10, 0)] == counts.max()


@pytest.mark.parametrize("rows", [1, 2, 10, 4096, 20_000, 1_000_003, 2**20 * 3])
def test_ranks_scatter_by_a_bijection_that_spreads_the_hot_rows(rows):
    """Every row is some rank's (a bijection), and the 128 hottest ranks fall in most of 128 equal row ranges (the
    row-wise shards of a 128-rank world), not in the first ones: hashed ids, as the row-wise cost model assumes."""
    for table in (0, 7):
        got = scatter_ranks(np.arange(rows), rows, table)
        assert np.array_equal(np.sort(got), np.arange(rows))
        if rows >= 4096:
            block = -(-rows // 128)
            assert len(np.unique(got[:128] // block)) >= 100, (rows, table)


def test_ranks_scatter_exactly_in_tables_beyond_int64_products():
    """Above 3e9 rows, rank x multiplier overflows an int64: the split product still gives the exact row (checked
    against the documented formula in Python integers, small tables too)."""
    for rows in (2**39 + 7, 20_000):
        m = round(rows * (5**0.5 - 1) / 2)
        while math.gcd(m, rows) != 1:
            m += 1
        c = ((3 + 1) * 0x632BE59BD9B4E019 % 2**64 >> 24) % rows
        ranks = np.array([0, 1, 2, 12345, rows - 1], dtype=np.int64)
        assert [int(g) for g in scatter_ranks(ranks, rows, 3)] == [(int(r) * m + c) % rows for r in ranks]


def test_num_samples_is_the_epoch_every_rank_cycles_through():
    """dsi.num_samples distinct samples: within an epoch the ranks' batches are disjoint and cover them all; then
    the same samples again in the same order, a batch that straddles the end taking the first ones."""
    n, world, b = 100, 2, 24
    ranks = [SyntheticSource(DATA, rank=r, world_size=world, batch_size=b, num_samples=n) for r in range(world)]
    seen = np.concatenate([src.next_batch().sample_ids.numpy() for _ in range(5) for src in ranks])
    assert seen.size == 240
    np.testing.assert_array_equal(seen[:100], np.arange(100))                  # one epoch, every sample once
    np.testing.assert_array_equal(seen[100:200], np.arange(100))               # then again, in the same order
    straddle = SyntheticSource(DATA, rank=0, world_size=1, batch_size=30, num_samples=n)
    straddle.load_state_dict({"step": 3})                                       # positions 90..119
    got = straddle.next_batch()
    np.testing.assert_array_equal(got.sample_ids.numpy(), np.r_[90:100, 0:20])
    want = BatchArrays.concat([DATA.batch_arrays(90, 10), DATA.batch_arrays(0, 20)])
    np.testing.assert_array_equal(got.values.numpy(), want.values)
    np.testing.assert_array_equal(got.lengths.numpy(), want.lengths)


def test_make_source_takes_the_epoch_from_dsi_num_samples(capsys):
    from conftest import compose_cfg
    from neocfg.data.source import make_source

    cfg = compose_cfg(["dsi.num_samples=600", "train.batch_size=256"])
    src = make_source(cfg, 0, 2)
    ids = np.concatenate([src.next_batch().sample_ids.numpy() for _ in range(3)])
    src.close()
    # rank 0 of 2: positions 0, 512, 1024 -> samples 0.., 512..599 then 0..167, 424..
    np.testing.assert_array_equal(ids, np.r_[0:256, 512:600, 0:168, 424:600, 0:80])
    assert "warning" not in capsys.readouterr().out
    small = make_source(compose_cfg(["dsi.num_samples=300", "train.batch_size=256"]), 0, 2)
    small.close()
    assert "dsi.num_samples=300 (the synthetic epoch): every step repeats samples" in capsys.readouterr().out


def _source(step: int = 0) -> SyntheticSource:
    s = SyntheticSource(DATA, rank=1, world_size=2, batch_size=24)
    s.load_state_dict({"step": step})
    return s


def test_prefetcher_hands_out_the_same_batches_and_resumes_where_it_was():
    plain, pre = _source(), Prefetcher(_source())
    for _ in range(4):
        a, b = plain.next_batch(), pre.next_batch()
        assert (a.sample_ids == b.sample_ids).all() and (a.values == b.values).all()
    state = pre.state_dict()   # 4 batches handed out, a fifth already prepared in the background
    assert state == {"step": 4}
    resumed = Prefetcher(_source())
    resumed.load_state_dict(state)
    nxt = resumed.next_batch()
    assert (nxt.sample_ids == plain.next_batch().sample_ids).all()
    stats = pre.stats()
    assert stats["samples_delivered"] == 4 * 24 and stats["data_wait_seconds"] >= 0
    for s in (pre, resumed):
        s.close()


def test_prefetcher_prepares_every_batch_in_its_thread():
    """prepare_with(fn): fn runs on every batch in the prefetch thread (the trainer's id exchange runs there)."""
    seen = []

    def prepare(batch):
        seen.append(threading.current_thread().name)
        return dataclasses.replace(batch, prepared=int(batch.sample_ids[0]))

    plain, pre = _source(), Prefetcher(_source())
    pre.prepare_with(prepare)
    for _ in range(3):
        a, b = plain.next_batch(), pre.next_batch()
        assert b.prepared == int(a.sample_ids[0]) and (a.values == b.values).all()
    assert all(name.startswith("neocfg-prefetch") for name in seen) and len(seen) >= 3
    stats = pre.stats()
    assert stats["batches_prepared"] == len(seen) and stats["data_prepare_seconds"] >= 0
    pre.close()


def test_cycled_source_hands_out_the_streams_first_batches_in_a_cycle():
    """dsi.cycle_batches=N: the first N batches of the rank's stream, generated once, then again in the same order
    (TorchRec's RandomRecDataset num_generated_batches); nothing is generated after construction."""
    stream = _source()
    cycled = SyntheticSource(DATA, rank=1, world_size=2, batch_size=24, cycle=3)
    first = [stream.next_batch() for _ in range(3)]
    calls = []
    cycled.data = type("Counting", (), {"batch": lambda self, *a: calls.append(a)})()
    got = [cycled.next_batch() for _ in range(7)]
    assert not calls
    for i, b in enumerate(got):
        want = first[i % 3]
        assert (b.sample_ids == want.sample_ids).all() and (b.values == want.values).all()
        assert (b.lengths == want.lengths).all() and (b.labels == want.labels).all()
    assert len({int(b.sample_ids[0]) for b in got}) == 3
    assert cycled.stats()["samples_delivered"] == 7 * 24
    cycled.load_state_dict({"step": 4})   # resumes at its place in the cycle
    assert (cycled.next_batch().sample_ids == first[1].sample_ids).all()


def test_cycle_batches_is_checked_and_only_cycles_training():
    from conftest import compose_cfg

    from neocfg.data.source import make_source
    from neocfg.errors import ConfigError

    cfg = compose_cfg(["model=dlrm_tiny", "dsi.cycle_batches=2", "train.batch_size=16"])
    train, held_out = make_source(cfg, 0, 2), make_source(cfg, 0, 2, eval=True)
    ids = [int(train.next_batch().sample_ids[0]) for _ in range(4)]
    assert ids == [0, 32, 0, 32]
    held = [int(held_out.next_batch().sample_ids[0]) for _ in range(3)]
    assert len(set(held)) == 3
    for s in (train, held_out):
        s.close()
    with pytest.raises(ConfigError, match="dsi.cycle_batches"):
        compose_cfg(["dsi.cycle_batches=-1"])
    with pytest.raises(ConfigError, match="dsi.cycle_batches.*parquet"):
        compose_cfg(["dsi=parquet_local", "dsi.path=/tmp/x", "dsi.cycle_batches=4"])


def test_prefetcher_hands_out_pregenerated_batches_in_the_callers_thread():
    """dsi.cycle_batches: with nothing to produce or prepare the batches are handed out by the caller's thread (no
    hand-off to the prefetch thread and back each step), the same batches in the same order, resumable."""
    def source():
        return SyntheticSource(DATA, rank=1, world_size=2, batch_size=24, cycle=3)

    plain, pre = source(), Prefetcher(source())
    threads = []
    produce = pre._produce
    pre._produce = lambda: (threads.append(threading.current_thread()), produce())[1]
    for _ in range(5):
        a, b = plain.next_batch(), pre.next_batch()
        assert (a.sample_ids == b.sample_ids).all() and (a.values == b.values).all()
    assert threads == [threading.current_thread()] * 5 and pre.pending is None
    assert pre.state_dict() == {"step": 5} and pre.stats()["samples_delivered"] == 5 * 24
    resumed = Prefetcher(source())
    resumed.load_state_dict(pre.state_dict())
    assert (resumed.next_batch().sample_ids == plain.next_batch().sample_ids).all()
    # something to prepare: the thread again
    pre.prepare_with(lambda batch: batch)
    pre.next_batch()
    assert threads[-1] is not threading.current_thread()
    for s in (pre, resumed):
        s.close()


@pytest.mark.parametrize("rows", [1, 2, 20_000, 2**23 + 9, FLOAT_SCATTER_ROWS - 1, FLOAT_SCATTER_ROWS - 3])
def test_float_scatter_is_exact_up_to_its_row_limit(rows):
    """Below FLOAT_SCATTER_ROWS the generator scatters in float64: the exact (rank x m + c) mod rows (Python
    integers) for ranks 0 .. rows + 1, at the edges (the ranks whose row is 0 or rows - 1) and at random."""
    for table in (0, 5):
        m, c = (int(x[0]) for x in _scatter_constants(np.array([rows]), np.array([table])))
        edge = [((k - c) * pow(m, -1, rows)) % rows if rows > 1 else 0 for k in (0, rows - 1, rows // 2)]
        ranks = np.r_[0, 1, 2, rows - 1, rows, rows + 1, edge, [e + rows for e in edge],
                      np.random.default_rng(rows).integers(0, rows + 2, 100_000)].astype(np.int64)
        want = [(int(r) * m + c) % rows for r in ranks]
        got = _scatter_float(ranks.astype(np.float64), m / rows, (c + 0.5) / rows, float(rows))
        assert got.tolist() == want, (rows, table)


@pytest.mark.parametrize("rows", [2**20 + 5, FLOAT_SCATTER_ROWS + 7])
def test_large_tables_draw_in_float64_and_scatter_in_int64(rows):
    """Above FLOAT32_ROWS the Zipf law runs in float64, above FLOAT_SCATTER_ROWS the scatter in int64: ids stay in
    range and the hottest rank's share is the law's."""
    n, alpha = 200_000, 1.1
    ids = zipf_ids(np.random.default_rng(2), rows, alpha, n, tables=[3])
    assert ids.min() >= 0 and ids.max() < rows
    e = 1.0 - alpha
    p1 = (2**e - 1) / ((rows + 1) ** e - 1)
    freq = float(np.mean(ids == scatter_ranks(0, rows, 3)))
    assert abs(freq - p1) < 5 * np.sqrt(p1 * (1 - p1) / n), (freq, p1)


def test_pooling_lengths_follow_the_reference_law():
    """The chunk's guide-table inverse CDF draws the pooling law: 1 + Poisson(p - 1), Bernoulli(p) below 1."""
    pooling = [0.0, 0.3, 1.0, 1.5, 2.6, 14.7, 130.0, 3000.0]
    n = 100_000
    got = _LengthLaw.of(pooling).sample(np.random.default_rng(4), n)
    assert got.shape == (len(pooling), n)
    for p, lengths in zip(pooling, got):
        if p < 1:
            pmf = {0: 1 - p, 1: p}
        else:
            lam = p - 1
            ks = np.arange(max(0, int(lam - 8 * np.sqrt(lam) - 10)), int(lam + 8 * np.sqrt(lam) + 10))
            pmf = {int(k) + 1: math.exp(k * math.log(lam) - lam - math.lgamma(k + 1)) if lam else float(k == 0)
                   for k in ks}
        assert lengths.min() >= min(pmf) and lengths.max() <= max(pmf), p
        counts = np.bincount(lengths - min(pmf), minlength=len(pmf))
        for k, pk in pmf.items():
            f = counts[k - min(pmf)] / n
            assert abs(f - pk) < 5 * np.sqrt(pk * (1 - pk) / n) + 1e-4, (p, k, f, pk)
        assert float(lengths.mean()) == pytest.approx(p, abs=5 * np.sqrt(max(p - 1, p * (1 - p), 1e-9) / n) + 1e-9)


@pytest.mark.parametrize("block", [1, 3, 7, 64])
def test_bag_sums_added_block_by_block_equal_the_whole_arrays(block):
    lengths = np.random.default_rng(block).poisson(2.0, (3, 11))
    lengths[1, 4:7] = 0
    values = np.random.default_rng(0).random(int(lengths.sum())).astype(np.float32)
    bags = _BlockBagSums(lengths)
    for lo in range(0, len(values), block):
        bags.add(lo, values[lo:lo + block])
    whole = _BlockBagSums(lengths)
    whole.add(0, values)
    np.testing.assert_allclose(bags.sums(), whole.sums(), rtol=1e-6)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_an_idle_prefetch_thread_runs_in_sched_idle_and_hands_out_the_same_batches():
    """Prefetcher(idle=True) (the plan's prefetch_idle) puts its thread in SCHED_IDLE, and only there: the default
    keeps the thread in the normal class; the batches are the same either way."""
    got = {}
    for idle in (False, True):
        src = Prefetcher(_source(), idle=idle)
        policy = src.pool.submit(os.sched_getscheduler, 0).result()
        got[idle] = (policy, [src.next_batch().values.numpy().copy() for _ in range(3)])
        src.close()
    assert got[True][0] == os.SCHED_IDLE and got[False][0] == os.SCHED_OTHER
    for a, b in zip(got[True][1], got[False][1]):
        np.testing.assert_array_equal(a, b)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER      # the caller's thread is left as it was
