"""One home per sharding type: `SCHEMES[sharding]` gives its shard geometry, routing, output kind (and so its
collectives) and cost terms, read by the planner and the runtime alike.

Adding a sharding type: a ShardingType member, one module here with a Scheme subclass, its entry in SCHEMES, and
its tests (tests/test_runtime_sharding.py checks every registered scheme's geometry; the correctness tests run
every type sharded against unsharded).
"""

from __future__ import annotations

from typing import Iterable

from neocfg.sharding.base import (IDS_COLLECTIVES, OUTPUT_COLLECTIVES, FBGEMM_DIM_ALIGN, OutputKind, PieceShape,
                                  Routing, Scheme, ceil_div, column_slices, row_block, row_ranges)
from neocfg.sharding.column_wise import ColumnWise
from neocfg.sharding.data_parallel import DataParallel
from neocfg.sharding.row_wise import RowWise
from neocfg.sharding.table_column_wise import TableColumnWise
from neocfg.sharding.table_row_wise import TableRowWise
from neocfg.sharding.table_wise import TableWise
from neocfg.types import ShardingType

SCHEMES: dict[ShardingType, Scheme] = {s.sharding: s for s in (
    TableWise(), ColumnWise(), TableColumnWise(), RowWise(), TableRowWise(), DataParallel())}
assert set(SCHEMES) == set(ShardingType), "every ShardingType needs a Scheme"


def embedding_collectives(shardings: Iterable[ShardingType]) -> int:
    """Collectives per step of a plan whose tables use these sharding types (the runtime batches all tables of an
    output kind into one collective, so the count depends on the kinds present, not on the number of tables)."""
    kinds = {SCHEMES[s].kind for s in shardings}
    return IDS_COLLECTIVES + sum(OUTPUT_COLLECTIVES[k] for k in kinds)


__all__ = ["SCHEMES", "Scheme", "OutputKind", "Routing", "PieceShape", "IDS_COLLECTIVES", "OUTPUT_COLLECTIVES",
           "FBGEMM_DIM_ALIGN", "embedding_collectives", "row_ranges", "row_block", "column_slices", "ceil_div"]
