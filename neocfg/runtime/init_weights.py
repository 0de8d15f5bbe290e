"""Initial embedding weights, identical however a table is sharded or replicated."""

from __future__ import annotations

import torch

# Rows per independently seeded init block: any shard can initialize its rows without the rest of the table.
INIT_BLOCK_ROWS = 4096


def init_rows(seed: int, table: int, num_embeddings: int, dim: int, row_offset: int, num_rows: int,
              col_offset: int = 0, num_cols: int | None = None) -> torch.Tensor:
    """Initial weights of rows [row_offset, +num_rows) and columns [col_offset, +num_cols) of a table, identical
    however the table is sharded: U(-1/sqrt(n), 1/sqrt(n)) (TorchRec's EmbeddingBagConfig default), drawn per block
    of INIT_BLOCK_ROWS rows from a generator seeded by (seed, table, block)."""
    num_cols = dim - col_offset if num_cols is None else num_cols
    bound = num_embeddings ** -0.5
    out = torch.empty(num_rows, num_cols)
    r = row_offset
    while r < row_offset + num_rows:
        block = r // INIT_BLOCK_ROWS
        gen = torch.Generator().manual_seed((seed * 1_000_003 + table) * 1_000_003 + block)
        lo = block * INIT_BLOCK_ROWS
        rows = min(INIT_BLOCK_ROWS, num_embeddings - lo)
        w = torch.rand(rows, dim, generator=gen) * (2 * bound) - bound
        hi = min(lo + rows, row_offset + num_rows)
        out[r - row_offset:hi - row_offset] = w[r - lo:hi - lo, col_offset:col_offset + num_cols]
        r = hi
    return out
