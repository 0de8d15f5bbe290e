"""The sharding optimizer: `make_plan(cfg)` decides how every embedding table is sharded and placed.

Stages (one module each): options (candidate shardings per table) -> costs (time and memory of each piece) ->
greedy / ilp (choose and place) -> assemble (the Plan contract) -> dpp (data-pipeline worker sizing).
"""

from __future__ import annotations

from neocfg.config.schema import NeocfgConfig
from neocfg.plan import Plan


def make_plan(cfg: NeocfgConfig) -> Plan:
    """Plan the model on the hardware with `cfg.planner.algorithm`; raises InfeasibleError if it cannot fit."""
    from neocfg.planner.pipeline import make_plan as _make_plan

    return _make_plan(cfg)


__all__ = ["make_plan"]
