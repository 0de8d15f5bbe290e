"""table_column_wise: column_wise with every slice on the ranks of one node (the planner keeps it there)."""

from __future__ import annotations

from neocfg.sharding.base import Spread
from neocfg.sharding.column_wise import ColumnWise
from neocfg.types import ShardingType


class TableColumnWise(ColumnWise):
    sharding = ShardingType.table_column_wise
    spread = Spread.node_distinct
    abbrev = "TWCW"
