"""The batch the runtime consumes, from synthetic generation or from DPP workers.

Sparse features are laid out like TorchRec's KeyedJaggedTensor: for T tables and B samples, `lengths` is [T, B]
(ids per sample per table) and `values` holds all ids, table-major then sample-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Batch:
    dense: torch.Tensor        # [B, num_dense] float32
    lengths: torch.Tensor      # [T, B] int64
    values: torch.Tensor       # [sum(lengths)] int64, ids in each table's own row space
    labels: torch.Tensor       # [B] float32 in {0, 1}
    sample_ids: torch.Tensor   # [B] int64, unique over the dataset
    # [sum(lengths)] float32: each id's weight in its bag's sum (datasets mapping dsi.columns.weights), or None:
    # every id weighs 1 (synthetic and neocfg-written data).
    weights: Optional[torch.Tensor] = None
    # Work its consumer did on it ahead of the step, in the data source's prefetch thread (Prefetcher.prepare_with;
    # the sharded embeddings' routed ids), or None.
    prepared: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_tables(self) -> int:
        return int(self.lengths.shape[0])

    def pin_memory(self) -> "Batch":
        """A copy in page-locked host memory (so that copies to a GPU can be non_blocking)."""
        return Batch(self.dense.pin_memory(), self.lengths.pin_memory(), self.values.pin_memory(),
                     self.labels.pin_memory(), self.sample_ids.pin_memory(),
                     None if self.weights is None else self.weights.pin_memory())

    def offsets(self) -> torch.Tensor:
        """fbgemm-style offsets over all (table, sample) bags: [T * B + 1]."""
        flat = self.lengths.reshape(-1)
        return torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])

    def table_values(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, lengths) of table t."""
        per_table = self.lengths.sum(dim=1)
        start = int(per_table[:t].sum())
        return self.values[start:start + int(per_table[t])], self.lengths[t]
