"""Validate a plan before anything uses it: typed fields, shards on ranks of the world, and every table's shards
covering its rows x columns exactly once (data_parallel: one full replica per rank, in a dtype replicas are stored in).

A hand-edited or foreign plan.json (planner.plan_file) goes through load_plan_file: the first fault becomes one
PlanError line naming the file, the table and what is wrong; nothing is trained or written with a wrong plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from neocfg.config.model import ModelConfig
from neocfg.errors import DataError
from neocfg.plan import Plan
from neocfg.sharding import FBGEMM_DIM_ALIGN, SCHEMES, has_all_to_all
from neocfg.types import (CommDtype, DenseGradSync, IdDtype, IdsExchange, MemoryTier, RoutingEncoding, ShardingType,
                          WeightsDtype)

_SHARD_FIELDS = ("rank", "row_offset", "num_rows", "col_offset", "num_cols")


class PlanError(DataError):
    """A plan file that must not be used: `<file>: table <name>: <fault>`."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, fault: str) -> PlanError:
        return PlanError(f"{self.source}: {where}: {fault}")

    def int_field(self, d: dict, key: str, where: str, lo: int = 0) -> int:
        if key not in d:
            raise self.fail(where, f"missing {key}")
        v = d[key]
        if not _is_int(v):
            raise self.fail(where, f"{key}={v!r} must be an integer, not {type(v).__name__}")
        if v < lo:
            raise self.fail(where, f"{key}={v} must be >= {lo}")
        return v

    def enum_field(self, d: dict, key: str, where: str, enum: type) -> None:
        v = d.get(key)
        allowed = [m.value for m in enum]
        if v not in allowed:
            raise self.fail(where, f"{key}={v!r} is not one of {', '.join(allowed)}")


def check_plan_dict(d: Any, source: str) -> None:
    """Types and presence of every field the runtime and the estimator read (before Plan.from_dict trusts them)."""
    c = _Checker(source)
    if not isinstance(d, dict):
        raise c.fail("plan", f"expected a JSON object, got {type(d).__name__}")
    for key in ("world_size", "nodes", "devices_per_node", "batch_size_per_device"):
        c.int_field(d, key, "plan", lo=1)
    for key in ("a2a_fwd_dtype", "a2a_bwd_dtype"):
        c.enum_field(d, key, "plan", CommDtype)
    if not isinstance(d.get("model_name"), str):
        raise c.fail("plan", f"model_name={d.get('model_name')!r} must be a string")
    tables = d.get("tables")
    if not isinstance(tables, list) or not tables:
        raise c.fail("plan", "tables must be a non-empty list")
    for i, t in enumerate(tables):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise c.fail(f"tables[{i}]", "must be an object with a string name")
        where = f"table {t['name']}"
        c.int_field(t, "num_embeddings", where, lo=1)
        c.int_field(t, "embedding_dim", where, lo=1)
        c.enum_field(t, "sharding", where, ShardingType)
        c.enum_field(t, "memory", where, MemoryTier)
        c.enum_field(t, "weights_dtype", where, WeightsDtype)
        ratio = t.get("cache_ratio", 0.0)
        if not _is_num(ratio) or not 0.0 <= ratio <= 1.0:
            raise c.fail(where, f"cache_ratio={ratio!r} must be a number in [0, 1]")
        shards = t.get("shards")
        if not isinstance(shards, list) or not shards:
            raise c.fail(where, "shards must be a non-empty list")
        for j, s in enumerate(shards):
            if not isinstance(s, dict):
                raise c.fail(f"{where} shard {j}", "must be an object")
            extra = sorted(set(s) - set(_SHARD_FIELDS))
            if extra:
                raise c.fail(f"{where} shard {j}", f"unknown field(s) {', '.join(extra)}; "
                                                   f"allowed: {', '.join(_SHARD_FIELDS)}")
            for key in _SHARD_FIELDS:
                c.int_field(s, key, f"{where} shard {j}")
    _check_strategies(c, d.get("strategies"))
    for key in ("devices", "estimate", "solver"):
        if key not in d:
            raise c.fail("plan", f"missing {key} (a plan.json as mode=plan writes it has one)")


def _check_strategies(c: _Checker, st: Any) -> None:
    """The optional strategies section: resolved choices only (no auto), each of its allowed values."""
    if st is None:
        return
    if not isinstance(st, dict):
        raise c.fail("strategies", f"expected an object, got {type(st).__name__}")
    if not isinstance(st.get("pipeline"), bool):
        raise c.fail("strategies", f"pipeline={st.get('pipeline')!r} must be true or false")
    for key in ("output_overlap", "prefetch_idle", "sums_by_all_to_all"):
        if not isinstance(st.get(key, False), bool):
            raise c.fail("strategies", f"{key}={st.get(key)!r} must be true or false")
    for key, enum in (("ids_exchange", IdsExchange), ("dense_grad_sync", DenseGradSync), ("id_dtype", IdDtype),
                      ("routing_encoding", RoutingEncoding)):
        allowed = [m.value for m in enum if m.value != "auto"]
        if st.get(key) not in allowed:
            raise c.fail("strategies", f"{key}={st.get(key)!r} is not one of {', '.join(allowed)}")


def _covers_exactly_once(rows: int, cols: int, rects: Sequence[tuple[int, int, int, int]]) -> Optional[str]:
    """None if the (row_off, n_rows, col_off, n_cols) rectangles tile [0,rows) x [0,cols) exactly once, else the
    first fault (a gap or an overlap, with its rows and columns)."""
    edges = sorted({0, cols} | {c for _, _, co, nc in rects for c in (co, co + nc)})
    for lo, hi in zip(edges, edges[1:]):
        band = sorted((ro, ro + nr) for ro, nr, co, nc in rects if nr > 0 and co <= lo and hi <= co + nc)
        at = 0
        for start, end in band:
            if start > at:
                return f"rows {at}..{start - 1} of columns {lo}..{hi - 1} are in no shard (a gap)"
            if start < at:
                return (f"rows {start}..{min(at, end) - 1} of columns {lo}..{hi - 1} are in more than one shard "
                        f"(an overlap)")
            at = end
        if at < rows:
            return f"rows {at}..{rows - 1} of columns {lo}..{hi - 1} are in no shard (a gap)"
    return None


def check_plan(plan: Plan, source: str, model: Optional[ModelConfig] = None,
               world_size: Optional[int] = None) -> None:
    """The plan's geometry against itself, the model (names, rows, dims) and the world (when given)."""
    c = _Checker(source)
    world = plan.world_size
    if plan.nodes * plan.devices_per_node != world:
        raise c.fail("plan", f"world_size {world} is not nodes {plan.nodes} x devices_per_node "
                             f"{plan.devices_per_node}")
    if world_size is not None and world != world_size:
        raise c.fail("plan", f"the plan is for world size {world}, the hardware has {world_size} devices")
    names = [t.name for t in plan.tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise c.fail(f"table {dup[0]}", "appears more than once in the plan")
    if model is not None:
        want = {t.name: t for t in model.tables}
        missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
        if missing:
            raise c.fail(f"table {missing[0]}", f"is in model {model.name} but not in the plan "
                                                f"({len(missing)} missing); re-plan for this model")
        if extra:
            raise c.fail(f"table {extra[0]}", f"is in the plan but not in model {model.name}; re-plan for this model")
        for t in plan.tables:
            m = want[t.name]
            if (t.num_embeddings, t.embedding_dim) != (m.num_embeddings, m.embedding_dim):
                raise c.fail(f"table {t.name}", f"is {t.num_embeddings}x{t.embedding_dim} in the plan but "
                                                f"{m.num_embeddings}x{m.embedding_dim} in model {model.name}")
    for t in plan.tables:
        fault = table_fault(t, world, plan.devices_per_node)
        if fault:
            raise c.fail(f"table {t.name}", fault)
    fault = strategies_fault(plan)
    if fault:
        raise c.fail("strategies", fault)


def strategies_fault(plan: Plan) -> Optional[str]:
    """The first step strategy the plan's placement cannot run, or None (the runtime's Trainer relies on it): the
    dense gradients riding in, or the bottom MLP overlapping, the outputs' all-to-all need some table whose outputs
    come back by it (its sharding type's output kind on its ranks: neocfg.sharding.has_all_to_all); overlapping an
    all-to-all that carries the dense gradients would wait for the whole dense backward."""
    st = plan.strategies
    if st is None:
        return None
    exchange = st.dense_grad_sync is DenseGradSync.exchange
    if st.output_overlap and exchange:
        return ("output_overlap=true with dense_grad_sync=exchange: the dense gradients ride in the outputs' backward "
                "all-to-all, which waits for the dense backward; allowed: output_overlap=false, or "
                "dense_grad_sync=ddp")
    if not (st.output_overlap or exchange) or has_all_to_all(plan.tables, plan.world_size, plan.devices_per_node):
        return None
    key, allowed = ("output_overlap=true", "output_overlap=false") if st.output_overlap else \
        ("dense_grad_sync=exchange", "dense_grad_sync=ddp")
    return (f"{key}, but no table's pooled outputs come back by all-to-all (every table is row-wise, "
            f"table-row-wise or data-parallel as placed); allowed: {allowed}")


def table_fault(t: Any, world: int, per_node: int) -> Optional[str]:
    """The first fault of one planned table, or None: its shards inside the world and the table, covering it once
    (replicas: whole), then its sharding type's own rules and geometry (Scheme.fault, which the runtime's layout
    applies too: a plan this accepts is one the runtime runs)."""
    n, d, shards = t.num_embeddings, t.embedding_dim, t.shards
    for s in shards:
        if not 0 <= s.rank < world:
            return f"a shard is on rank {s.rank}, outside the world (ranks 0..{world - 1})"
        if s.row_offset + s.num_rows > n:
            return f"the shard on rank {s.rank} ends at row {s.row_offset + s.num_rows}, past the table's {n} rows"
        if s.col_offset + s.num_cols > d:
            return (f"the shard on rank {s.rank} ends at column {s.col_offset + s.num_cols}, past the table's "
                    f"{d} columns")
        if s.num_cols == 0:
            return f"the shard on rank {s.rank} has no columns"
        if s.num_cols % FBGEMM_DIM_ALIGN:
            return (f"the shard on rank {s.rank} is {s.num_cols} columns wide; fbgemm needs a multiple of "
                    f"{FBGEMM_DIM_ALIGN}")
    scheme = SCHEMES[t.sharding]
    if scheme.tiles:
        gap = _covers_exactly_once(n, d, [(s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in shards])
        if gap:
            return gap
    return scheme.fault(t, world, per_node)


def load_plan_file(path: str | Path, model: Optional[ModelConfig] = None,
                   world_size: Optional[int] = None) -> Plan:
    """Read planner.plan_file, check its types, then its geometry (against the model and world when given)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path}: plan file not found (planner.plan_file)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not a valid neocfg plan.json ({type(exc).__name__}: {exc})") from None
    check_plan_dict(raw, str(path))
    try:
        plan = Plan.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: not a valid neocfg plan.json ({type(exc).__name__}: {exc})") from None
    check_plan(plan, str(path), model, world_size)
    return plan


def fault_of(plan: Plan, model: Optional[ModelConfig] = None) -> Optional[str]:
    """The first fault of an in-memory plan (for plans built in code, e.g. converted from TorchRec), or None."""
    try:
        check_plan(plan, "plan", model)
    except PlanError as exc:
        return str(exc)
    return None
