"""Batch-layout numpy arrays: what DPP workers produce and clients turn into a torch Batch (zero-copy).

Same layout as neocfg.batch.Batch (lengths [T, n], values table-major then sample-major), without torch so that
worker processes start without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class BatchArrays:
    dense: np.ndarray       # [n, D] float32
    lengths: np.ndarray     # [T, n] int64
    values: np.ndarray      # [sum(lengths)] int64
    labels: np.ndarray      # [n] float32
    sample_ids: np.ndarray  # [n] int64
    weights: Optional[np.ndarray] = None  # [sum(lengths)] float32 per-id weights (dsi.columns.weights), or None

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.dense, self.lengths, self.values, self.labels, self.sample_ids,
                                      *(() if self.weights is None else (self.weights,))))

    def _table_bounds(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths.sum(axis=1))])

    def slice(self, start: int, stop: int) -> "BatchArrays":
        """Rows [start, stop): one gather over every table's id range, no loop over tables."""
        if start == 0 and stop == self.rows:
            return self
        bounds = self._table_bounds()
        before = self.lengths[:, :start].sum(axis=1)
        counts = self.lengths[:, start:stop].sum(axis=1)
        index = gather_index(bounds[:-1] + before, counts)
        return BatchArrays(dense=self.dense[start:stop], lengths=self.lengths[:, start:stop],
                           values=self.values[index], labels=self.labels[start:stop],
                           sample_ids=self.sample_ids[start:stop],
                           weights=None if self.weights is None else self.weights[index])

    def split_batches(self, batch_size: int) -> list["BatchArrays"]:
        """Consecutive pieces of batch_size rows; the last one is shorter when rows is not a multiple."""
        return [self.slice(a, min(a + batch_size, self.rows)) for a in range(0, self.rows, batch_size)]

    @staticmethod
    def concat(parts: list["BatchArrays"]) -> "BatchArrays":
        """The rows of all parts in order: values re-interleaved table-major, each part's run of each table copied
        once (one concatenate of T x P views: a gather through an index of every id took as long as generating
        the chunks, 17 ms a batch of 512 samples x 4,500 ids, measured)."""
        if len(parts) == 1:
            return parts[0]
        bounds = [p._table_bounds().tolist() for p in parts]
        runs = [(p, b[t], b[t + 1]) for t in range(parts[0].lengths.shape[0]) for p, b in zip(parts, bounds)]
        weights = None if parts[0].weights is None else np.concatenate([p.weights[a:z] for p, a, z in runs])
        return BatchArrays(dense=np.concatenate([p.dense for p in parts]),
                           lengths=np.concatenate([p.lengths for p in parts], axis=1),
                           values=np.concatenate([p.values[a:z] for p, a, z in runs]),
                           labels=np.concatenate([p.labels for p in parts]),
                           sample_ids=np.concatenate([p.sample_ids for p in parts]), weights=weights)


def gather_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Indices of the ranges [starts[i], starts[i] + counts[i]) concatenated in order (vectorized)."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    shift = np.asarray(starts, np.int64) - (ends - counts)   # per range: source index - output index
    return np.arange(total, dtype=np.int64) + np.repeat(shift, counts)
