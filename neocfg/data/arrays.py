"""Batch-layout numpy arrays: what DPP workers produce and clients turn into a torch Batch (zero-copy).

Same layout as neocfg.batch.Batch (lengths [T, n], values table-major then sample-major), without torch so that
worker processes start without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BatchArrays:
    dense: np.ndarray       # [n, D] float32
    lengths: np.ndarray     # [T, n] int64
    values: np.ndarray      # [sum(lengths)] int64
    labels: np.ndarray      # [n] float32
    sample_ids: np.ndarray  # [n] int64

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.dense, self.lengths, self.values, self.labels, self.sample_ids))

    def _table_bounds(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths.sum(axis=1))])

    def slice(self, start: int, stop: int) -> "BatchArrays":
        """Rows [start, stop)."""
        bounds = self._table_bounds()
        parts = []
        for t in range(self.lengths.shape[0]):
            offs = np.concatenate([[0], np.cumsum(self.lengths[t])])
            parts.append(self.values[bounds[t] + offs[start]:bounds[t] + offs[stop]])
        values = np.concatenate(parts) if parts else self.values[:0]
        return BatchArrays(dense=self.dense[start:stop], lengths=self.lengths[:, start:stop], values=values,
                           labels=self.labels[start:stop], sample_ids=self.sample_ids[start:stop])

    def split_batches(self, batch_size: int) -> list["BatchArrays"]:
        """Consecutive pieces of batch_size rows; the last one is shorter when rows is not a multiple."""
        return [self.slice(a, min(a + batch_size, self.rows)) for a in range(0, self.rows, batch_size)]

    @staticmethod
    def concat(parts: list["BatchArrays"]) -> "BatchArrays":
        if len(parts) == 1:
            return parts[0]
        num_tables = parts[0].lengths.shape[0]
        per_part = [p._table_bounds() for p in parts]
        values = [p.values[b[t]:b[t + 1]] for t in range(num_tables) for p, b in zip(parts, per_part)]
        return BatchArrays(dense=np.concatenate([p.dense for p in parts]),
                           lengths=np.concatenate([p.lengths for p in parts], axis=1),
                           values=np.concatenate(values) if values else parts[0].values[:0],
                           labels=np.concatenate([p.labels for p in parts]),
                           sample_ids=np.concatenate([p.sample_ids for p in parts]))
