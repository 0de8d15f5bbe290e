"""Synthetic DLRM samples with a learnable signal, deterministic per sample index.

Sample i is generated from chunk i // CHUNK_SIZE with a generator seeded by (seed, chunk), so any rank or DPP
worker can produce any range of samples independently and identically. Ids of table t follow a Zipf law with the
table's zipf_alpha, its ranks scattered over the table's rows by a fixed bijection per table (scatter_ranks: hot
rows spread over the whole row range, as hashed categorical ids are); each sample has about pooling_factor ids per
table. The label is
Bernoulli(sigmoid(logit)) where the logit is a hidden linear function of the dense features plus, per table, the mean
of a hidden per-id score: a model with embeddings can learn it, a constant predictor cannot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from neocfg.batch import Batch
from neocfg.config.model import ModelConfig
from neocfg.data.arrays import BatchArrays

# Samples per generator seed. Small, so that a rank generates little beyond its own batch (ranks take turns
# through the sample range): on a prod_856-shaped model (4,900 ids per sample) a 4,096-sample chunk took seconds.
CHUNK_SIZE = 256
# Chunks kept per process: a trainer reads consecutive batches, which share a chunk until it is used up (a batch
# smaller than a chunk: the next batch of the same rank starts in the chunk this one ends in). More is memory
# churn: until the cache starts evicting, every chunk's arrays are fresh pages from the OS (prod_856 x2.6's 26 MB of
# ids a chunk); measured on this project's 2-core box, that chunk's first 24 generations (one rank's sequence):
# 8 cached 45-100 ms each for the first 8, 40-45 after; 2 cached 40-46 from the second on.
CHUNKS_CACHED = 2
# Scale of the hidden logit: with unit-variance dense and sparse parts this gives a Bayes AUC of about 0.85.
LOGIT_SCALE = 2.0
# The rank -> row bijection's multiplier is the first integer coprime with the rows from rows x this (the golden
# ratio's fractional part: consecutive ranks land far apart, and any run of them spreads evenly; Knuth, TAOCP 6.4).
_GOLDEN = (5 ** 0.5 - 1) / 2
# Below this many rows, rank x multiplier + offset fits an int64 (3.03e9^2 < 2^63).
_DIRECT_ROWS = 3_037_000_499
# id_score's 32-bit hash: Knuth's multiplicative constant (2^32 / golden ratio), then murmur3 fmix32's multiplier
# and shifts (32-bit lanes: half the memory and vectorized multiplies of a 64-bit hash, on millions of ids per batch).
_HASH_MULT = np.uint32(0x9E3779B1)
_MIX_MULT = np.uint32(0x85EBCA6B)
# Ids generated per block: each block's dozen passes (draw, scatter, score) stay in the core's caches instead of
# streaming millions of ids through memory once per pass (prod_856 at 12,600 ids per sample: 3.2M ids per chunk).
# Measured on this project's 2-core box, a 3.2M-id chunk (median of 18): 2^17 ids per block 45 ms, 2^16 43 ms,
# 2^15 44 ms, 2^14 45 ms, 2^13 50 ms.
ID_BLOCK = 1 << 16
# Below this many rows in every table the Zipf inverse CDF runs in float32 on 24-bit uniforms (half of one 64-bit
# draw each; the logs and products at twice float64's SIMD width): a float32 rank of at most 2^20 is off by a few
# units in 10^6 of itself, a shift of the cold tail far below any sample's resolution.
FLOAT32_ROWS = 1 << 20
# Below this many rows the scatter's (rank x mult + offset) mod rows runs in float64, exactly (a = mult / rows,
# b = (offset + 1/2) / rows: the fraction of rank x a + b is (row + 1/2) / rows within 2^-27, a quarter of the gap
# to the next row's, for ranks up to rows + 1; tests/test_synthetic_source.py checks the edge): no per-id int64
# division, which numpy does one scalar at a time (~2.5 ns per id here, a fifth of a prod_856 chunk).
FLOAT_SCATTER_ROWS = 1 << 24
# Cells of the pooling law's guide table per support value (Chen and Asau's guide table for an inverse CDF): the
# search from a cell's first value steps over about 1 / this boundaries on average.
LENGTH_GUIDE_CELLS = 2
# The pooling law's support: Poisson(lam) mass beyond lam +- (this x sqrt(lam) + 30) is below 1e-30 (Chernoff).
POISSON_SUPPORT_SIGMAS = 12


@dataclass(frozen=True)
class SyntheticData:
    """Everything needed to regenerate samples: table shapes, skew, pooling and the seed."""

    num_dense: int
    rows: tuple[int, ...]
    pooling: tuple[float, ...]
    alphas: tuple[float, ...]
    seed: int

    @staticmethod
    def for_model(model: ModelConfig, seed: int) -> "SyntheticData":
        return SyntheticData(
            num_dense=model.num_dense_features,
            rows=tuple(t.num_embeddings for t in model.tables),
            pooling=tuple(t.pooling_factor for t in model.tables),
            alphas=tuple(t.alpha for t in model.tables),
            seed=seed)

    @property
    def dense_weights(self) -> np.ndarray:
        w = np.random.default_rng([self.seed, 2**31 - 1]).standard_normal(self.num_dense)
        return w / max(np.linalg.norm(w), 1e-12)

    @functools.cached_property
    def _tables(self) -> "_TableArrays":
        return _TableArrays.of(self)

    def id_score(self, table: int | np.ndarray, ids: np.ndarray, salts: Optional[np.ndarray] = None) -> np.ndarray:
        """Hidden per-id score in [-1, 1) (float32); `table` is one table index or one per id (salts: every table's
        _score_salt, taken by index instead of hashed per id). Ids hash by their low 32 bits."""
        salt = (_score_salt(np.asarray(table, dtype=np.uint64)) if salts is None
                else salts.take(np.asarray(table)))
        return _hash_score(ids, salt)

    # A batch smaller than a chunk would otherwise regenerate its whole chunk; callers only read (concatenate) these.
    @functools.lru_cache(maxsize=CHUNKS_CACHED)
    def _chunk(self, chunk: int) -> BatchArrays:
        """CHUNK_SIZE samples, every table drawn at once (one draw per kind, per-table parameters repeated over each
        block's runs of ids: the ids are table-major)."""
        rng = np.random.default_rng([self.seed, chunk])
        n, tabs = CHUNK_SIZE, self._tables
        dense = rng.standard_normal((n, self.num_dense)).astype(np.float32)
        lengths = tabs.lengths.sample(rng, n)                                            # [T, n]
        per_table = lengths.sum(axis=1)
        values = np.empty(int(per_table.sum()), np.int64)
        scratch = _Scratch(min(len(values), ID_BLOCK))
        bags = _BlockBagSums(lengths)
        for lo, hi, first, counts in table_runs(per_table, ID_BLOCK):   # (zipf_ids' draws block by block, scores)
            ids = tabs.zipf.draw(rng, first, counts, values[lo:hi], scratch)
            salts = np.repeat(tabs.salts[first:first + len(counts)], counts)
            bags.add(lo, _hash_score(ids, salts, scratch.f32[0][:hi - lo], scratch))
        sums = bags.sums()
        sparse_part = (sums / np.maximum(lengths, 1)).sum(axis=0)
        # A uniform[-1, 1) mean over >=1 ids has variance <= 1/3 per table; normalize the sum to about unit scale.
        sparse_part /= np.sqrt(max(len(self.rows), 1) / 3.0)
        dense_part = dense.astype(np.float64) @ self.dense_weights if self.num_dense else np.zeros(n)
        logit = LOGIT_SCALE * (dense_part + sparse_part) / np.sqrt(2.0)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        ids = np.arange(chunk * n, (chunk + 1) * n, dtype=np.int64)
        return BatchArrays(dense=dense, lengths=lengths, values=values, labels=labels, sample_ids=ids)

    def batch_arrays(self, start: int, count: int) -> BatchArrays:
        """Samples [start, start + count) in the Batch layout (lengths [T, count], values table-major)."""
        first, last = start // CHUNK_SIZE, (start + count - 1) // CHUNK_SIZE
        parts = BatchArrays.concat([self._chunk(c) for c in range(first, last + 1)])
        lo = start - first * CHUNK_SIZE
        return parts.slice(lo, lo + count)

    def arrays(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Samples [start, start + count) as numpy arrays (dense, lengths [T, B], values, labels, sample_ids)."""
        return dataclasses.asdict(self.batch_arrays(start, count))

    def batch(self, start: int, count: int) -> Batch:
        return as_batch(self.batch_arrays(start, count))


def as_batch(a: BatchArrays) -> Batch:
    """The torch Batch over the same memory (zero-copy)."""
    return Batch(dense=torch.from_numpy(a.dense), lengths=torch.from_numpy(a.lengths),
                     values=torch.from_numpy(a.values), labels=torch.from_numpy(a.labels),
                     sample_ids=torch.from_numpy(a.sample_ids))


@dataclass(frozen=True)
class _TableArrays:
    """Per-table generation parameters as arrays, indexed by table."""

    salts: np.ndarray       # [T] uint32: _score_salt of each table
    lengths: "_LengthLaw"   # the pooling law of every table
    zipf: "_ZipfLaw"        # zipf_ids' constants of every table

    @staticmethod
    def of(data: SyntheticData) -> "_TableArrays":
        index = np.arange(len(data.rows), dtype=np.int64)
        with np.errstate(over="ignore"):
            salts = _score_salt(index.astype(np.uint64))
        return _TableArrays(salts=salts, lengths=_LengthLaw.of(data.pooling),
                            zipf=_ZipfLaw.of(data.rows, data.alphas, index))


class _BlockBagSums:
    """Sum of each bag's values (float64; empty bags 0), bags of `lengths` consecutive values, the values given block
    by block (each block's scores summed while they are in the cache, not stored for the whole chunk): one
    np.add.reduceat pass per block, in the values' own dtype (float32 sums cast per block: asking reduceat for
    float64 sums of float32 values casts them value by value, ~10x slower); a bag that straddles blocks adds each
    block's part."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths
        flat = lengths.reshape(-1)
        self.filled = flat > 0
        self.starts = (np.cumsum(flat) - flat)[self.filled]   # the non-empty bags' starts (increasing)
        self.filled_sums = np.zeros(len(self.starts))

    def add(self, lo: int, values: np.ndarray) -> None:
        """values: the values of positions [lo, lo + len(values)), after every earlier position's."""
        if not len(values):
            return
        i0, i1 = np.searchsorted(self.starts, [lo, lo + len(values)])
        heads = self.starts[i0:i1] - lo
        lead = i0 == i1 or heads[0] > 0   # (the block opens inside bag i0 - 1)
        if lead:
            heads = np.concatenate([[0], heads])
        part = np.add.reduceat(values, heads)
        if lead:
            self.filled_sums[i0 - 1] += part[0]
        self.filled_sums[i0:i1] += part[int(lead):]

    def sums(self) -> np.ndarray:
        out = np.zeros(self.lengths.shape)
        out.reshape(-1)[self.filled] = self.filled_sums
        return out


def _hash_score(ids: np.ndarray, salt, out: Optional[np.ndarray] = None,
                scratch: Optional["_Scratch"] = None) -> np.ndarray:
    """id_score of ids under their tables' 32-bit salts (one, or one per id), into `out` (float32) if given."""
    h, t = (np.empty(ids.shape, np.uint32) for _ in range(2)) if scratch is None else (
        b[:len(ids)] for b in scratch.u32)
    np.copyto(h, ids, casting="unsafe")
    h ^= salt
    h *= _HASH_MULT
    h ^= np.right_shift(h, np.uint32(16), out=t)
    h *= _MIX_MULT
    h ^= np.right_shift(h, np.uint32(13), out=t)
    out = np.multiply(h, np.float32(2.0 / float(1 << 32)), out=out, dtype=np.float32, casting="unsafe")
    out -= np.float32(1.0)
    return out


def _score_salt(table: np.ndarray) -> np.ndarray:
    """id_score's 32-bit per-table salt: _table_salt folded to its low 32 bits."""
    salt = _table_salt(table)
    return (salt ^ (salt >> np.uint64(32))).astype(np.uint32)


def _table_salt(table: np.ndarray) -> np.ndarray:
    """A per-table offset of the score hash: (table + 1) * odd constant, wrapping mod 2^64."""
    with np.errstate(over="ignore"):
        return (table + np.uint64(1)) * np.uint64(0x632BE59BD9B4E019)


@dataclass(frozen=True)
class _LengthLaw:
    """Ids per sample with mean pooling factor p, per table: 1 + Poisson(p - 1) for p >= 1, Bernoulli(p) below; drawn
    by an inverse CDF with a guide table (Chen and Asau, 1974): a sample's length is the first support value whose
    CDF exceeds its uniform, found from the uniform's guide cell in a step or two. A constant number of numpy passes
    over the [T, n] draws, instead of numpy's Poisson sampler (~45 ns a draw here: a prod_856 chunk draws 219,000)."""

    cdf: np.ndarray      # every table's CDF over its support window, concatenated (each ends at exactly 1.0)
    low: np.ndarray      # [T] the window's first length
    start: np.ndarray    # [T] the window's first index in cdf
    cells: np.ndarray    # [T] float64: guide cells of the table (a power of 2)
    guide: np.ndarray    # every table's guide, concatenated: index in cdf of the first value whose CDF > cell / cells
    gstart: np.ndarray   # [T] the table's first index in guide

    @staticmethod
    def of(pooling) -> "_LengthLaw":
        cdfs, lows, guides = [], [], []
        for p in np.atleast_1d(np.asarray(pooling, np.float64)):
            if p < 1.0:
                low, pmf = 0, np.array([1.0 - p, p])
            else:   # 1 + Poisson(lam) on lam +- (POISSON_SUPPORT_SIGMAS sqrt(lam) + 30)
                lam = p - 1.0
                half = POISSON_SUPPORT_SIGMAS * np.sqrt(lam) + 30
                k = np.arange(max(0, int(lam - half)), int(lam + half) + 1, dtype=np.float64)
                log_fact = np.array([math.lgamma(x + 1.0) for x in k]) if len(k) < 64 else _log_factorials(k)
                pmf = np.exp(k * np.log(lam) - lam - log_fact) if lam > 0 else (k == 0).astype(np.float64)
                low = int(k[0]) + 1
            cdf = np.cumsum(pmf)
            cdf /= cdf[-1]   # (the mass outside the window, below 1e-30, and the sum's rounding)
            cdf[-1] = 1.0
            cells = 1 << int(LENGTH_GUIDE_CELLS * len(cdf) - 1).bit_length()   # (a power of 2: u x cells is exact)
            guides.append(np.searchsorted(cdf, np.arange(cells) / cells, side="right"))
            cdfs.append(cdf)
            lows.append(low)
        sizes = np.array([len(c) for c in cdfs], np.int64)
        gsizes = np.array([len(g) for g in guides], np.int64)
        start, gstart = np.cumsum(sizes) - sizes, np.cumsum(gsizes) - gsizes
        guide = np.concatenate([g + s for g, s in zip(guides, start)]) if guides else np.zeros(0, np.int64)
        return _LengthLaw(cdf=np.concatenate(cdfs) if cdfs else np.zeros(0), low=np.array(lows, np.int64),
                          start=start, cells=gsizes.astype(np.float64), guide=guide, gstart=gstart)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[T, n] lengths, n samples per table, from T x n uniforms of rng."""
        u = rng.random((len(self.low), n))
        cell = u * self.cells[:, None]
        at = self.guide.take(cell.astype(np.intp) + self.gstart[:, None])
        step = np.flatnonzero(u.reshape(-1) >= self.cdf.take(at.reshape(-1)))
        flat, uf = at.reshape(-1), u.reshape(-1)
        while len(step):   # (the cell's value is below the uniform's: the next one, until the CDF exceeds it)
            flat[step] += 1
            step = step[uf.take(step) >= self.cdf.take(flat.take(step))]
        at -= (self.start - self.low)[:, None]
        return at


def _log_factorials(k: np.ndarray) -> np.ndarray:
    """log(k!) of consecutive k (float64 integers from k[0]): lgamma at the first, then a running sum of logs."""
    out = np.log(np.maximum(k, 1.0))
    out[0] = math.lgamma(k[0] + 1.0)
    return np.cumsum(out)


def table_runs(per_table: np.ndarray, block: int):
    """(lo, hi, first, counts) per block of at most `block` consecutive ids of a table-major layout with per_table[t]
    ids of table t: ids [lo, hi) are counts[i] ids of table first + i, table after table."""
    per_table = np.asarray(per_table, np.int64)
    ends = np.cumsum(per_table)
    starts = ends - per_table
    total = int(ends[-1]) if len(ends) else 0
    for lo in range(0, total, block):
        hi = min(lo + block, total)
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))
        counts = np.minimum(ends[first:last], hi) - np.maximum(starts[first:last], lo)
        yield lo, hi, first, counts


@dataclass(frozen=True)
class _ZipfLaw:
    """zipf_ids' per-table constants; draw() turns one block's runs of tables into ids."""

    rows: np.ndarray       # [T] int64
    rows_f: np.ndarray     # [T] float64
    # log(rank) = scale log1p(c u) + d u (d = log(rows + 1), c = scale = 0 where harmonic: alpha = 1; else d = 0),
    # u = 24-bit integers where the law runs in float32 (c, d in units of 2^-24), uniforms of [0, 1) in float64
    c: np.ndarray          # [T] ftype
    scale: np.ndarray      # [T] ftype
    d: np.ndarray          # [T] ftype
    harmonic: np.ndarray   # [T] bool
    mult: np.ndarray       # [T] scatter_ranks' multiplier
    offset: np.ndarray     # [T] and offset
    offset1: np.ndarray    # [T] offset - mult (mod rows): the row of 1-based rank r is (r mult + offset1) mod rows
    a: np.ndarray          # [T] float64 mult / rows: the float scatter's constants (FLOAT_SCATTER_ROWS)
    b: np.ndarray          # [T] float64 (offset + 1/2) / rows (offset1 where the ranks are 1-based: not uniform)
    uniform: bool          # every alpha 0: rank = floor(rows u), 0-based, the same law without the logs
    ftype: type            # float32 below FLOAT32_ROWS rows in every table, else float64
    max_rows: int

    @staticmethod
    def of(num_rows, alpha, tables) -> "_ZipfLaw":
        rows = np.atleast_1d(np.asarray(num_rows, np.int64))
        a = np.broadcast_to(np.asarray(alpha, np.float64), rows.shape)
        log_top = np.log(rows + 1.0)
        e = 1.0 - a
        harmonic = np.abs(e) < 1e-9
        e_safe = np.where(harmonic, 1.0, e)
        mult, offset = _scatter_constants(rows, tables)
        offset1 = (offset - mult) % rows
        max_rows = int(rows.max(initial=1))
        ft = np.float32 if max_rows < FLOAT32_ROWS else np.float64
        unit = 2.0 ** -24 if ft is np.float32 else 1.0
        uniform = not a.any()
        return _ZipfLaw(rows=rows, rows_f=rows.astype(np.float64),
                        c=(np.where(harmonic, 0.0, np.expm1(e_safe * log_top)) * unit).astype(ft),
                        scale=np.where(harmonic, 0.0, 1.0 / e_safe).astype(ft),
                        d=(np.where(harmonic, log_top, 0.0) * unit).astype(ft), harmonic=harmonic, mult=mult,
                        offset=offset, offset1=offset1, a=mult / rows,
                        b=((offset if uniform else offset1) + 0.5) / rows, uniform=uniform, ftype=ft,
                        max_rows=max_rows)

    def draw(self, rng: np.random.Generator, first: int, counts: np.ndarray, out: np.ndarray,
             scratch: Optional["_Scratch"] = None) -> np.ndarray:
        """counts[i] ids of table first + i, table after table, written to `out` (int64); per-table constants
        repeated over the runs (np.repeat of a few values: ~5x cheaper than a take() per id), every pass into
        `scratch`'s buffers (fresh block-sized temporaries would each be page-faulted in again whenever the
        allocator hands memory back to the system: up to 2x a prod_856 chunk's time, measured).

        The 1-based rank floor(exp(...)) lies in [1, rows] (u < 1; rows + 1 only by a rounding, which the modulo
        of the scatter folds onto rank 1's row), so it goes to the scatter without a clip or a shift (offset1)."""
        tables = slice(first, first + len(counts))
        n = len(out)
        sc = scratch if scratch is not None else _Scratch(n)

        def rep(per_table: np.ndarray) -> np.ndarray:
            return np.repeat(per_table[tables], counts)

        if self.uniform:
            rank = rng.random(out=sc.f64[0][:n])
            rank *= rep(self.rows_f)
        else:
            if self.ftype is np.float32:   # 24-bit integers, two per 64-bit draw
                bits = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
                bits >>= np.uint32(8)
                u = sc.f32[0][:n]
                np.copyto(u, bits, casting="unsafe")
                rank = sc.f32[1][:n]
            else:
                u, rank = rng.random(out=sc.f64[0][:n]), sc.f64[1][:n]
            np.multiply(rep(self.c), u, out=rank)
            np.log1p(rank, out=rank)
            rank *= rep(self.scale)
            if self.harmonic[tables].any():
                h = rep(self.d)
                h *= u
                rank += h
            np.exp(rank, out=rank)
        np.floor(rank, out=rank)
        if self.max_rows < FLOAT_SCATTER_ROWS:
            y = sc.f64[2][:n]
            np.copyto(y, rank)
            return _scatter_float(y, rep(self.a), rep(self.b), rep(self.rows_f), out, sc.f64[1][:n])
        return _scatter(rank.astype(np.int64), rep(self.rows), rep(self.mult),
                        rep(self.offset if self.uniform else self.offset1), self.max_rows, out)


class _Scratch:
    """Block-sized buffers that a chunk's blocks reuse: float32 x 2, float64 x 3, uint32 x 2."""

    def __init__(self, n: int):
        self.f32 = [np.empty(n, np.float32) for _ in range(2)]
        self.f64 = [np.empty(n, np.float64) for _ in range(3)]
        self.u32 = [np.empty(n, np.uint32) for _ in range(2)]


def zipf_ids(rng: np.random.Generator, num_rows, alpha, counts, tables=None) -> np.ndarray:
    """counts[t] ids in [0, num_rows[t]) per table t, table after table, with P(rank r) ~ r^-alpha[t] (continuous
    inverse CDF), ranks scattered over the rows by scatter_ranks (tables: the tables' indices, default 0, 1, ...).
    Scalars are one table.

    The inverse CDF in log form, rank = exp(log1p((top^e - 1) u) / e) with e = 1 - alpha (rank = top^u when
    alpha = 1), per-table constants repeated over each table's run of ids, in blocks of ID_BLOCK ids."""
    counts = np.atleast_1d(np.asarray(counts, np.int64))
    rows = np.atleast_1d(np.asarray(num_rows, np.int64))
    tables = np.arange(len(rows), dtype=np.int64) if tables is None else np.atleast_1d(np.asarray(tables, np.int64))
    law = _ZipfLaw.of(rows, alpha, tables)
    out = np.empty(int(counts.sum()), np.int64)
    scratch = _Scratch(min(len(out), ID_BLOCK))
    for lo, hi, first, run in table_runs(counts, ID_BLOCK):
        law.draw(rng, first, run, out[lo:hi], scratch)
    return out


def scatter_ranks(ranks, num_rows: int, table: int) -> np.ndarray:
    """Row of each Zipf rank (0 = the hottest) of table `table` with `num_rows` rows: (rank x m + c) mod rows, m the
    first integer coprime with the rows from rows x 0.618... (consecutive ranks land a golden-ratio fraction of the
    table apart), c a per-table offset. A bijection of the rows, like the hash of a production pipeline's
    categorical ids: hot rows are spread over the whole row range, as row-wise sharding and the planner's row-wise
    cost model (lookups split evenly over the row ranges) assume. Exact below 2^40 rows (in float64 below
    FLOAT_SCATTER_ROWS, as the generator scatters)."""
    ranks = np.asarray(ranks, np.int64)
    mult, offset = _scatter_constants(np.array([num_rows], np.int64), np.array([table], np.int64))
    if num_rows < FLOAT_SCATTER_ROWS:
        return _scatter_float(ranks.astype(np.float64), mult[0] / num_rows, (offset[0] + 0.5) / num_rows,
                              float(num_rows))
    n = np.full(ranks.shape, num_rows, np.int64)
    return _scatter(ranks.copy(), n, np.full_like(n, mult[0]), np.full_like(n, offset[0]), num_rows)


def _scatter_constants(rows: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scatter_ranks' (m, c) per table."""
    mult = np.maximum(np.rint(rows * _GOLDEN).astype(np.int64), 1)
    while True:
        bad = np.gcd(mult, rows) != 1
        if not bad.any():
            return mult, (_table_salt(tables.astype(np.uint64)) >> np.uint64(24)).astype(np.int64) % rows
        mult[bad] += 1


def _scatter_float(ranks: np.ndarray, a, b, rows, out: Optional[np.ndarray] = None,
                   tmp: Optional[np.ndarray] = None) -> np.ndarray:
    """(ranks x mult + offset) mod rows in float64 for rows below FLOAT_SCATTER_ROWS and ranks in [0, rows + 1]
    (float64 integers, overwritten), given a = mult / rows and b = (offset + 1/2) / rows: the fraction of
    ranks x a + b is (row + 1/2) / rows within 3 x 2^-29 (three roundings of values below 2^24), so row = floor(that
    fraction x rows) exactly. Into `out` (int64) if given; tmp: a float64 buffer of the ranks' size."""
    ranks *= a
    ranks += b
    ranks -= np.floor(ranks, out=tmp)
    ranks *= rows
    if out is None:
        return ranks.astype(np.int64)
    np.copyto(out, ranks, casting="unsafe")
    return out


def _scatter(ranks: np.ndarray, rows: np.ndarray, mult: np.ndarray, offset: np.ndarray, max_rows: int,
             out: Optional[np.ndarray] = None) -> np.ndarray:
    """(ranks x mult + offset) mod rows elementwise in int64, without overflow; in `out` if given, else in place in
    `ranks`."""
    if max_rows < _DIRECT_ROWS:
        ranks *= mult
    else:   # mult = hi x 2^20 + lo, each product below 2^60 for rows below 2^40
        lo = ranks * (mult & ((1 << 20) - 1))
        ranks *= mult >> 20
        np.remainder(ranks, rows, out=ranks)
        ranks <<= 20
        ranks += lo
    ranks += offset
    return np.remainder(ranks, rows, out=ranks if out is None else out)
