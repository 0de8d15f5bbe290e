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
# Chunks kept per process: a trainer reads consecutive batches, which share a chunk until it is used up.
CHUNKS_CACHED = 8
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
# Measured on this project's 2-core box, a 3.2M-id chunk: 2^16 ids per block 67 ms, 2^15 68 ms, 2^14 71 ms.
ID_BLOCK = 1 << 16


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
        h = ids.astype(np.uint32)
        h ^= salt
        h *= _HASH_MULT
        h ^= h >> np.uint32(16)
        h *= _MIX_MULT
        h ^= h >> np.uint32(13)
        out = h.astype(np.float32)
        out *= np.float32(2.0 / float(1 << 32))
        out -= np.float32(1.0)
        return out

    # A batch smaller than a chunk would otherwise regenerate its whole chunk; callers only read (concatenate) these.
    @functools.lru_cache(maxsize=CHUNKS_CACHED)
    def _chunk(self, chunk: int) -> BatchArrays:
        """CHUNK_SIZE samples, every table drawn at once (one draw per kind, per-table parameters by index)."""
        rng = np.random.default_rng([self.seed, chunk])
        n, tabs = CHUNK_SIZE, self._tables
        dense = rng.standard_normal((n, self.num_dense)).astype(np.float32)
        lengths = sample_lengths(rng, tabs.pooling[:, None], (len(self.rows), n))        # [T, n]
        per_table = lengths.sum(axis=1)
        table_of_id = expand(per_table)
        values, scores = np.empty(len(table_of_id), np.int64), np.empty(len(table_of_id), np.float32)
        for lo in range(0, len(values), ID_BLOCK):   # (zipf_ids' draws, block by block, then their scores)
            tab = table_of_id[lo:lo + ID_BLOCK].astype(np.intp)
            ids = tabs.zipf.draw(rng, tab, out=values[lo:lo + ID_BLOCK])
            scores[lo:lo + ID_BLOCK] = self.id_score(tab, ids, salts=tabs.salts)
        sums = bag_sums(scores, lengths.reshape(-1)).reshape(lengths.shape)
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
    """Per-table generation parameters as arrays, indexed by table (or by each id's table)."""

    index: np.ndarray     # [T] int64
    rows: np.ndarray      # [T] int64
    pooling: np.ndarray   # [T] float64
    alphas: np.ndarray    # [T] float64
    salts: np.ndarray     # [T] uint32: _score_salt of each table
    zipf: "_ZipfLaw"      # zipf_ids' constants of every table

    @staticmethod
    def of(data: SyntheticData) -> "_TableArrays":
        index = np.arange(len(data.rows), dtype=np.int64)
        with np.errstate(over="ignore"):
            salts = _score_salt(index.astype(np.uint64))
        return _TableArrays(index=index, rows=np.asarray(data.rows, np.int64),
                            pooling=np.asarray(data.pooling, np.float64), alphas=np.asarray(data.alphas, np.float64),
                            salts=salts, zipf=_ZipfLaw.of(data.rows, data.alphas, index))


def expand(counts: np.ndarray) -> np.ndarray:
    """i repeated counts[i] times, for i = 0, 1, ... in the narrowest integer type that holds the indices (int16
    below 32,768 segments, else int32 or int64): np.repeat fills runs of 2- and 4-byte items ~50x faster than of
    8-byte ones, and a narrow index array halves or quarters the traffic of every take() by it (3.2M ids of 856
    tables: ~40 ms as int64, <1 ms as int16)."""
    counts = np.asarray(counts, np.int64).reshape(-1)
    dtype = np.int16 if len(counts) <= np.iinfo(np.int16).max + 1 else np.int32 if len(counts) <= 2**31 else np.int64
    return np.repeat(np.arange(len(counts), dtype=dtype), counts)


def bag_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sum of each bag's values (as float64), bags of `lengths` consecutive values: one np.add.reduceat pass over
    the values, accumulated in their own dtype (asking reduceat for float64 sums of float32 values casts them
    value by value in its buffered loop: ~10x slower on millions of scores); empty bags sum to 0."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    sums = np.zeros(len(lengths))
    filled = lengths > 0   # (reduceat sums up to the next start: the non-empty bags' starts strictly increase)
    if filled.any():
        sums[filled] = np.add.reduceat(values, (np.cumsum(lengths) - lengths)[filled])
    return sums


def _score_salt(table: np.ndarray) -> np.ndarray:
    """id_score's 32-bit per-table salt: _table_salt folded to its low 32 bits."""
    salt = _table_salt(table)
    return (salt ^ (salt >> np.uint64(32))).astype(np.uint32)


def _table_salt(table: np.ndarray) -> np.ndarray:
    """A per-table offset of the score hash: (table + 1) * odd constant, wrapping mod 2^64."""
    with np.errstate(over="ignore"):
        return (table + np.uint64(1)) * np.uint64(0x632BE59BD9B4E019)


def sample_lengths(rng: np.random.Generator, pooling_factor, shape) -> np.ndarray:
    """Ids per sample with mean pooling_factor (a scalar, or an array broadcast to `shape`): 1 + Poisson(p - 1) for
    p >= 1, Bernoulli(p) below."""
    p = np.broadcast_to(np.asarray(pooling_factor, np.float64), shape)
    poisson = 1 + rng.poisson(np.maximum(p - 1.0, 0.0), shape).astype(np.int64)
    bernoulli = (rng.random(shape) < p).astype(np.int64)
    return np.where(p >= 1.0, poisson, bernoulli)


@dataclass(frozen=True)
class _ZipfLaw:
    """zipf_ids' per-table constants; draw() turns one block of ids' tables into ids."""

    rows: np.ndarray       # [T] int64
    log_top: np.ndarray    # [T] log(rows + 1)
    c: np.ndarray          # [T] log(rank) = scale * log1p(c u), or log_top * u where harmonic (alpha = 1; c = 0)
    scale: np.ndarray      # [T]
    harmonic: np.ndarray   # [T] bool
    mult: np.ndarray       # [T] scatter_ranks' multiplier
    offset: np.ndarray     # [T] and offset
    offset1: np.ndarray    # [T] offset - mult (mod rows): the row of 1-based rank r is (r mult + offset1) mod rows
    uniform: bool          # every alpha 0: rank = 1 + floor(rows u), the same law without the logs
    any_harmonic: bool

    @staticmethod
    def of(num_rows, alpha, tables) -> "_ZipfLaw":
        rows = np.atleast_1d(np.asarray(num_rows, np.int64))
        a = np.atleast_1d(np.asarray(alpha, np.float64))
        log_top = np.log(rows + 1.0)
        e = 1.0 - a
        harmonic = np.abs(e) < 1e-9
        e_safe = np.where(harmonic, 1.0, e)
        mult, offset = _scatter_constants(rows, tables)
        return _ZipfLaw(rows=rows, log_top=log_top, c=np.where(harmonic, 0.0, np.expm1(e_safe * log_top)),
                        scale=np.where(harmonic, 0.0, 1.0 / e_safe), harmonic=harmonic, mult=mult, offset=offset,
                        offset1=(offset - mult) % rows, uniform=not a.any(), any_harmonic=bool(harmonic.any()))

    def draw(self, rng: np.random.Generator, tab: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """One id per entry of tab (each id's table), from len(tab) uniforms of rng, written to `out` (int64) if
        given. tab is widened to intp once (take() would convert a narrow index array at every call).

        The 1-based rank floor(exp(...)) lies in [1, rows] (u < 1; rows + 1 only by a rounding, which the modulo
        of the scatter folds onto rank 1's row), so it goes to the scatter without a clip or a shift (offset1)."""
        tab = tab.astype(np.intp, copy=False)
        u = rng.random(len(tab))
        if self.uniform:
            u *= self.rows.take(tab)
            ranks, offset = u.astype(np.int64), self.offset      # 0-based
        else:
            log_rank = self.c.take(tab)
            log_rank *= u
            np.log1p(log_rank, out=log_rank)
            log_rank *= self.scale.take(tab)
            if self.any_harmonic:
                h = self.harmonic.take(tab)
                log_rank[h] = u[h] * self.log_top.take(tab[h])
            ranks, offset = np.exp(log_rank, out=log_rank).astype(np.int64), self.offset1   # floor, 1-based
        return _scatter(ranks, self.rows.take(tab), self.mult.take(tab), offset.take(tab),
                        int(self.rows.max(initial=1)), out)


def zipf_ids(rng: np.random.Generator, num_rows, alpha, counts, tables=None) -> np.ndarray:
    """counts[t] ids in [0, num_rows[t]) per table t, table after table, with P(rank r) ~ r^-alpha[t] (continuous
    inverse CDF), ranks scattered over the rows by scatter_ranks (tables: the tables' indices, default 0, 1, ...).
    Scalars are one table.

    The inverse CDF in log form, rank = exp(log1p((top^e - 1) u) / e) with e = 1 - alpha (rank = top^u when
    alpha = 1), per-table constants taken for each id by its table, in blocks of ID_BLOCK ids."""
    counts = np.atleast_1d(np.asarray(counts, np.int64))
    rows = np.atleast_1d(np.asarray(num_rows, np.int64))
    tables = np.arange(len(rows), dtype=np.int64) if tables is None else np.atleast_1d(np.asarray(tables, np.int64))
    law, tab = _ZipfLaw.of(rows, alpha, tables), expand(counts)
    out = np.empty(len(tab), np.int64)
    for lo in range(0, len(tab), ID_BLOCK):
        law.draw(rng, tab[lo:lo + ID_BLOCK], out=out[lo:lo + ID_BLOCK])
    return out


def scatter_ranks(ranks, num_rows: int, table: int) -> np.ndarray:
    """Row of each Zipf rank (0 = the hottest) of table `table` with `num_rows` rows: (rank x m + c) mod rows, m the
    first integer coprime with the rows from rows x 0.618... (consecutive ranks land a golden-ratio fraction of the
    table apart), c a per-table offset. A bijection of the rows, like the hash of a production pipeline's
    categorical ids: hot rows are spread over the whole row range, as row-wise sharding and the planner's row-wise
    cost model (lookups split evenly over the row ranges) assume. Exact below 2^40 rows."""
    ranks = np.asarray(ranks, np.int64)
    mult, offset = _scatter_constants(np.array([num_rows], np.int64), np.array([table], np.int64))
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


def _scatter(ranks: np.ndarray, rows: np.ndarray, mult: np.ndarray, offset: np.ndarray, max_rows: int,
             out: Optional[np.ndarray] = None) -> np.ndarray:
    """(ranks x mult + offset) mod rows elementwise, without int64 overflow; in `out` if given, else in place in
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
