"""Synthetic DLRM samples with a learnable signal, deterministic per sample index.

Sample i is generated from chunk i // CHUNK_SIZE with a generator seeded by (seed, chunk), so any rank or DPP
worker can produce any range of samples independently and identically. Ids of table t follow a Zipf law with the
table's zipf_alpha, permuted over the table's rows; each sample has about pooling_factor ids per table. The label is
Bernoulli(sigmoid(logit)) where the logit is a hidden linear function of the dense features plus, per table, the mean
of a hidden per-id score: a model with embeddings can learn it, a constant predictor cannot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from neocfg.batch import Batch
from neocfg.config.model import ModelConfig

CHUNK_SIZE = 4096
# Chunks kept per process: a trainer reads consecutive batches, which share a chunk until it is used up.
CHUNKS_CACHED = 4
# Scale of the hidden logit: with unit-variance dense and sparse parts this gives a Bayes AUC of about 0.85.
LOGIT_SCALE = 2.0
# Multipliers of the rank -> id permutation (primes; the second is used when the first divides the table size).
_PERM_PRIMES = (1_000_003, 998_244_353)
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


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

    def id_score(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Hidden per-id score in [-1, 1)."""
        salt = np.uint64(((table + 1) * 0x632BE59BD9B4E019) % (1 << 64))  # wrap in Python: numpy warns on scalars
        h = (ids.astype(np.uint64) + salt) * _HASH_MULT
        h ^= h >> np.uint64(29)
        return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0

    # A batch smaller than a chunk would otherwise regenerate its whole chunk; callers only read (concatenate) these.
    @functools.lru_cache(maxsize=CHUNKS_CACHED)
    def _chunk(self, chunk: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, chunk])
        n = CHUNK_SIZE
        dense = rng.standard_normal((n, self.num_dense)).astype(np.float32)
        lengths = np.empty((len(self.rows), n), dtype=np.int64)
        values, sparse_part = [], np.zeros(n)
        for t, (rows, pool, alpha) in enumerate(zip(self.rows, self.pooling, self.alphas)):
            lengths[t] = sample_lengths(rng, pool, n)
            ids = zipf_ids(rng, rows, alpha, int(lengths[t].sum()))
            values.append(ids)
            scores = self.id_score(t, ids)
            sums = np.bincount(np.repeat(np.arange(n), lengths[t]), weights=scores, minlength=n)
            sparse_part += sums / np.maximum(lengths[t], 1)
        # A uniform[-1, 1) mean over >=1 ids has variance <= 1/3 per table; normalize the sum to about unit scale.
        sparse_part /= np.sqrt(max(len(self.rows), 1) / 3.0)
        dense_part = dense.astype(np.float64) @ self.dense_weights if self.num_dense else np.zeros(n)
        logit = LOGIT_SCALE * (dense_part + sparse_part) / np.sqrt(2.0)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return {"dense": dense, "lengths": lengths, "values": np.concatenate(values) if values else np.zeros(0, np.int64),
                "labels": labels}

    def arrays(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Samples [start, start + count) as numpy arrays (dense, lengths [T, B], values, labels, sample_ids)."""
        first, last = start // CHUNK_SIZE, (start + count - 1) // CHUNK_SIZE
        parts = [self._chunk(c) for c in range(first, last + 1)]
        lo = start - first * CHUNK_SIZE
        dense = np.concatenate([p["dense"] for p in parts])[lo:lo + count]
        labels = np.concatenate([p["labels"] for p in parts])[lo:lo + count]
        lengths_all = np.concatenate([p["lengths"] for p in parts], axis=1)
        values_out = []
        for t in range(len(self.rows)):
            vals_t = np.concatenate([_table_values(p, t) for p in parts])
            offs = np.r_[0, np.cumsum(lengths_all[t])]
            values_out.append(vals_t[offs[lo]:offs[lo + count]])
        return {"dense": dense, "lengths": lengths_all[:, lo:lo + count], "values": np.concatenate(values_out),
                "labels": labels, "sample_ids": np.arange(start, start + count, dtype=np.int64)}

    def batch(self, start: int, count: int) -> Batch:
        a = self.arrays(start, count)
        return Batch(dense=torch.from_numpy(a["dense"]), lengths=torch.from_numpy(a["lengths"]),
                     values=torch.from_numpy(a["values"]), labels=torch.from_numpy(a["labels"]),
                     sample_ids=torch.from_numpy(a["sample_ids"]))


def _table_values(part: dict[str, np.ndarray], t: int) -> np.ndarray:
    per_table = part["lengths"].sum(axis=1)
    start = int(per_table[:t].sum())
    return part["values"][start:start + int(per_table[t])]


def sample_lengths(rng: np.random.Generator, pooling_factor: float, n: int) -> np.ndarray:
    """Ids per sample with mean pooling_factor: 1 + Poisson(p - 1) for p >= 1, Bernoulli(p) below."""
    if pooling_factor >= 1.0:
        return 1 + rng.poisson(pooling_factor - 1.0, n).astype(np.int64)
    return (rng.random(n) < pooling_factor).astype(np.int64)


def zipf_ids(rng: np.random.Generator, num_rows: int, alpha: float, n: int) -> np.ndarray:
    """n ids in [0, num_rows) with P(rank r) ~ r^-alpha (continuous inverse CDF), ranks permuted over the rows."""
    u = rng.random(n)
    top = float(num_rows) + 1.0
    if abs(alpha - 1.0) < 1e-9:
        ranks = np.power(top, u)
    else:
        e = 1.0 - alpha
        ranks = np.power((top**e - 1.0) * u + 1.0, 1.0 / e)
    ranks = np.clip(np.floor(ranks).astype(np.int64), 1, num_rows) - 1
    prime = next(p for p in _PERM_PRIMES if num_rows % p != 0)
    return (ranks * prime) % num_rows
