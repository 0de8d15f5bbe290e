"""The candidate shardings of every table: sharding type x memory tier x weight precision (x slice count),
narrowed by the planner's and the table's constraints, with dominated and never-fitting options dropped.

A table none of whose options fits an empty device raises InfeasibleError naming the table, the limit and what
would make it fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from neocfg.config.model import TableConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.errors import ConfigError, InfeasibleError
from neocfg.planner.costs import GIB, CostModel, ceil_div, dense_cost
from neocfg.planner.fixed import FixedCosts, lookup_group
from neocfg.planner.hiding import NO_HIDING, Hiding
from neocfg.planner.types import ShardingOption, Spread, Storage, Topology
from neocfg.sharding import FBGEMM_DIM_ALIGN, SCHEMES
from neocfg.tiers import TIERS
from neocfg.types import DeviceKind, MemoryTier, ShardingType, WeightsDtype

# TBE kernels need every slice's width to be a multiple of this.
COLUMN_ALIGN = FBGEMM_DIM_ALIGN


@dataclass(frozen=True)
class Choices:
    """What one table may use."""

    shardings: tuple[ShardingType, ...]
    tiers: tuple[MemoryTier, ...]
    dtypes: tuple[WeightsDtype, ...]


def allowed_tiers(cfg: NeocfgConfig) -> tuple[MemoryTier, ...]:
    tiers = tuple(cfg.planner.memory_tiers)
    if cfg.hardware.device.kind is DeviceKind.cpu:
        # fbgemm's CPU kernels run host-resident tables only: on a CPU rank its own memory is the one tier.
        if MemoryTier.hbm not in tiers:
            raise ConfigError("planner.memory_tiers", [t.value for t in tiers],
                              "on hardware.device.kind=cpu only 'hbm' (the rank's own memory) is supported")
        tiers = (MemoryTier.hbm,)
    return tiers


def table_choices(cfg: NeocfgConfig, table: TableConfig) -> Choices:
    def narrow(base: tuple, own: list | None) -> tuple:
        return base if own is None else tuple(x for x in base if x in own)

    tiers = allowed_tiers(cfg)
    return Choices(narrow(tuple(cfg.planner.sharding_types), table.sharding_types), narrow(tiers, table.memory_tiers),
                   narrow(tuple(cfg.planner.weights_dtypes), table.weights_dtypes))


def slice_counts(cfg: NeocfgConfig, table: TableConfig, sharding: ShardingType) -> list[int]:
    """Slice counts k >= 2 for which D/k is a multiple of 4 and k fits the world (CW) or one node (TWCW); the
    table's own column_slices instead where given (1 is then allowed: one slice, the whole width)."""
    d = table.embedding_dim
    limit = min(SCHEMES[sharding].max_slices(cfg.hardware.num_devices, cfg.hardware.devices_per_node),
                cfg.planner.max_column_slices)
    if table.column_slices is not None:
        ks = [len(table.ranks)] if table.ranks is not None else table.column_slices
        wide = SCHEMES[sharding].max_slices(cfg.hardware.num_devices, cfg.hardware.devices_per_node)
        return [k for k in ks if k == 1 or (k <= wide and (d // k) % COLUMN_ALIGN == 0 and d % k == 0)]
    if table.ranks is not None:
        ks = [len(table.ranks)]
    else:
        ks = [k for k in range(2, limit + 1) if k & (k - 1) == 0 or k == limit]
    return [k for k in ks if 2 <= k <= limit and d % k == 0 and (d // k) % COLUMN_ALIGN == 0]


def _geometry_ok(cfg: NeocfgConfig, table: TableConfig, sharding: ShardingType) -> bool:
    hw = cfg.hardware
    return SCHEMES[sharding].placeable(table.num_embeddings, table.ranks, hw.num_devices, hw.devices_per_node)


def _pieces(cfg: NeocfgConfig, sharding: ShardingType, k: int) -> int:
    return SCHEMES[sharding].num_pieces(cfg.hardware.num_devices, cfg.hardware.devices_per_node, k)


# Spreads whose placements include every placement of another with as many pieces: k distinct devices anywhere
# include k distinct devices of one node, and one device.
_WIDER_SPREAD = {(Spread.distinct, Spread.node_distinct), (Spread.distinct, Spread.one)}


def _places_like(a: ShardingOption, b: ShardingOption) -> bool:
    """a may take every set of devices b may (as many pieces, the same pinned ranks, a spread at least as wide) and
    issues the same collectives (one output kind: a in b's place changes no collective group's fixed cost)."""
    return (a.num_pieces == b.num_pieces and a.fixed_ranks == b.fixed_ranks
            and (a.spread is b.spread or (a.spread, b.spread) in _WIDER_SPREAD)
            and SCHEMES[a.sharding].kind is SCHEMES[b.sharding].kind)


def _dominates(a: ShardingOption, b: ShardingOption, group_ms: float, hiding: Hiding = NO_HIDING) -> bool:
    """Every plan choosing b is no better than the same plan with a in its place (same devices), so dropping b loses
    no plan better than one that is kept: a can take b's devices with the same collectives (its own sharding type,
    or column-wise in place of a table-column-wise of the same price), no more communication and no more memory
    in either tier, and on every device it touches it adds no more time. That time includes the lookup group's
    fixed cost (fixed.py): a piece of another group than b's may open a TBE group the device did not hold (+group_ms)
    while b's stays open for other tables, so across groups a must be faster by at least group_ms. (Alike options of
    two types that both stay leave the exact model to prove the same plans twice: tests/test_planner_solve.py's
    flat-ILP case took 10x longer.) Under output_overlap a piece of a may also let its device hide less of the
    outputs' all-to-all behind the bottom MLP than b's (hiding.py): a must be faster by that too."""
    margin = (0.0 if lookup_group(a) == lookup_group(b) else group_ms) + hiding.margin(a, b)
    return (_places_like(a, b)
            and a.perf.total + margin <= b.perf.total and a.perf.comm <= b.perf.comm
            and a.storage.hbm <= b.storage.hbm and a.storage.host <= b.storage.host)


def prune(options: list[ShardingOption], group_ms: float, hiding: Hiding = NO_HIDING) -> list[ShardingOption]:
    """The options no other one dominates (of options that dominate each other, the first); group_ms: the fixed
    cost of a device's lookup group (FixedCosts.group_ms); hiding: what the bottom MLP hides (hiding.py)."""
    kept: list[ShardingOption] = []
    for i, o in enumerate(options):
        dominated = any(_dominates(p, o, group_ms, hiding) and (not _dominates(o, p, group_ms, hiding) or j < i)
                        for j, p in enumerate(options) if j != i)
        if not dominated:
            kept.append(o)
    return kept


def stored_dtypes(cfg: NeocfgConfig, sharding: ShardingType) -> Optional[tuple[WeightsDtype, ...]]:
    """The weight dtypes the sharding type's pieces may be stored in (None: any): the scheme's, but data-parallel
    replicas as planner.replica_dtypes says (fp32 for neocfg's runtime; TorchRec's keeps a table's fp16)."""
    if sharding is ShardingType.data_parallel:
        return tuple(cfg.planner.replica_dtypes)
    return SCHEMES[sharding].weights_dtypes


def table_options(cfg: NeocfgConfig, cost: CostModel, index: int,
                  hiding: Optional[Hiding] = None) -> list[ShardingOption]:
    """Every allowed option of table `index` whose piece fits an empty device, dominated ones removed (hiding: what
    the bottom MLP hides, default cfg's)."""
    table = cfg.model.tables[index]
    ch = table_choices(cfg, table)
    shapes = [(s, k) for s in ch.shardings if _geometry_ok(cfg, table, s)
              for k in (slice_counts(cfg, table, s) if SCHEMES[s].sliced else [1])]
    if not shapes or not ch.tiers or not ch.dtypes:
        raise ConfigError(f"model.tables.{index}", table.name, _no_shape(cfg, table, ch))
    stored = [stored_dtypes(cfg, s) for s, _ in shapes]
    if all(d is not None and not set(ch.dtypes) & set(d) for d in stored):
        only = shapes[0][0]
        allowed = stored_dtypes(cfg, only) or ()
        raise ConfigError(f"model.tables.{index}", table.name,
                          f"{only.value} is its only allowed sharding type and its pieces are stored in"
                          f" {[d.value for d in allowed]}, but its weight dtypes are {[d.value for d in ch.dtypes]}:"
                          f" add {allowed[0].value} to planner.weights_dtypes (or the table's weights_dtypes) or"
                          f" allow another sharding type")
    # the largest device's capacity, where they differ
    out = [o for o in candidates(cfg, cost, index, table, ch) if o.storage.fits(cost.most_capacity)]
    if not out:
        raise InfeasibleError(explain_table(cfg, cost, index))
    if hiding is None:
        hiding = Hiding.of(cfg, cost, dense_cost(cfg))
    return prune(out, FixedCosts.of(cost).group_ms, hiding)


def candidates(cfg: NeocfgConfig, cost: CostModel, index: int, table: TableConfig,
               ch: Choices) -> list[ShardingOption]:
    """Every option of `table` (model index `index`) that `ch` and the table's ranks / slices allow, priced, whether
    or not it fits a device (neocfg.planner.explain compares a plan's choice with them)."""
    out: list[ShardingOption] = []
    fixed = tuple(table.ranks) if table.ranks is not None else None
    for sharding in ch.shardings:
        if not _geometry_ok(cfg, table, sharding):
            continue
        scheme = SCHEMES[sharding]
        stored = stored_dtypes(cfg, sharding)
        for k in slice_counts(cfg, table, sharding) if scheme.sliced else [1]:
            for tier in ch.tiers:
                if scheme.memory_tiers is not None and tier not in scheme.memory_tiers:
                    continue
                for dtype in ch.dtypes:
                    if stored is not None and dtype not in stored:
                        continue
                    perf, storage = cost.piece(table, sharding, tier, dtype, k)
                    out.append(ShardingOption(index, sharding, tier, dtype, _pieces(cfg, sharding, k), perf, storage,
                                              fixed))
    return out


def _no_shape(cfg: NeocfgConfig, table: TableConfig, ch: Choices) -> str:
    allowed = "; ".join(f"{name}: {[x.value for x in xs] or 'none'}" for name, xs in
                        (("sharding types", ch.shardings), ("memory tiers", ch.tiers), ("weight dtypes", ch.dtypes)))
    ranks = f", ranks {list(table.ranks)}" if table.ranks is not None else ""
    return (f"no allowed way to shard it ({allowed}{ranks}): table_wise takes 1 rank; column_wise /"
            f" table_column_wise one rank per slice, slices of a multiple of {COLUMN_ALIGN} columns, table_column_wise"
            f" within one node of {cfg.hardware.devices_per_node}; row_wise / table_row_wise / data_parallel take no"
            f" ranks and need a row per rank")


def all_options(cfg: NeocfgConfig, cost: CostModel) -> list[list[ShardingOption]]:
    opts, too_big = [], []
    hiding = Hiding.of(cfg, cost, dense_cost(cfg))
    for i in range(len(cfg.model.tables)):
        try:
            opts.append(table_options(cfg, cost, i, hiding))
        except InfeasibleError:
            too_big.append(i)
    if too_big:   # the largest table is the one to talk about, not the first in file order
        raise InfeasibleError(explain_table(cfg, cost, max(too_big, key=lambda i: _fp32_bytes(cfg.model.tables[i])),
                                            too_big))
    check_total_memory(cfg, cost, opts)
    return opts


def _fp32_bytes(table: TableConfig) -> int:
    return table.num_embeddings * table.embedding_dim * WeightsDtype.fp32.bytes


# Tables named in a "does not fit" line besides the largest.
NAMED_TABLES = 3


def _others(cfg: NeocfgConfig, too_big: list[int]) -> str:
    """' (N of the model's tables do not fit: largest first ...; model.shrink=true ...)'."""
    ranked = sorted((cfg.model.tables[i] for i in too_big), key=_fp32_bytes, reverse=True)
    named = ", ".join(f"{t.name} {_gib(_fp32_bytes(t))}" for t in ranked[:NAMED_TABLES + 1])
    more = f" and {len(ranked) - NAMED_TABLES - 1} more" if len(ranked) > NAMED_TABLES + 1 else ""
    count = f"{len(ranked)} of its {len(cfg.model.tables)} tables do not fit, largest first (fp32): {named}{more}"
    return f" ({count}; a laptop-sized copy for a local run: model.shrink=true)"


# ---- explaining infeasibility ----------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _smallest_piece(cost: CostModel, table: TableConfig, sharding: ShardingType, tier: MemoryTier,
                    dtype: WeightsDtype) -> Storage:
    return cost.piece(table, sharding, tier, dtype, 1)[1]


def explain_table(cfg: NeocfgConfig, cost: CostModel, index: int, too_big: list[int] | None = None) -> str:
    """Why table `index` fits no device, and what would make it fit; too_big: every table that does not fit (named
    largest first, with the option that shrinks the model)."""
    table = cfg.model.tables[index]
    hw = cfg.hardware
    ch = table_choices(cfg, table)
    cap = cost.capacity
    dtype = min(ch.dtypes, key=lambda d: d.bytes) if ch.dtypes else WeightsDtype.fp32
    best_sharding = ShardingType.row_wise if ShardingType.row_wise in ch.shardings else ch.shardings[0]
    tier = MemoryTier.host if MemoryTier.host in ch.tiers else ch.tiers[0]
    need = _smallest_piece(cost, table, best_sharding, tier, dtype)
    binding = "host DDR" if need.host > cap.host else "device memory (HBM)"
    have = cap.host if need.host > cap.host else cap.hbm
    used = need.host if need.host > cap.host else need.hbm
    fixes = []
    if WeightsDtype.fp16 not in ch.dtypes and cost.piece(table, best_sharding, tier, WeightsDtype.fp16, 1)[1].fits(cap):
        fixes.append("fp16 weights (planner.weights_dtypes=[fp32,fp16])")
    if cfg.hardware.device.kind is not DeviceKind.cpu:
        for t in sorted((t for t in TIERS if not TIERS[t].on_device), key=lambda t: not TIERS[t].hbm_cache):
            if t not in ch.tiers and cost.piece(table, best_sharding, t, dtype, 1)[1].fits(cap):
                fixes.append(f"memory tier {t.value} (planner.memory_tiers)")
                break
    if best_sharding is not ShardingType.row_wise and cost.piece(table, ShardingType.row_wise, tier, dtype,
                                                                 1)[1].fits(cap):
        fixes.append("row-wise sharding (planner.sharding_types)")
    nodes = _nodes_needed(cfg, cost, table, tier, dtype)
    if nodes:
        fixes.append(f"hardware.nodes>={nodes}")
    fix = "; would fit with " + " or ".join(fixes) if fixes else "; no allowed setting makes it fit"
    return (f"table {table.name} ({table.num_embeddings:,} x {table.embedding_dim}) does not fit: its smallest"
            f" {best_sharding.value} shard at {dtype.value} in {tier.value} needs {_gib(used)} of {binding}, a"
            f" {hw.name} device has {_gib(have)} usable{_others(cfg, too_big) if too_big else ''}{fix}")


def _nodes_needed(cfg: NeocfgConfig, cost: CostModel, table: TableConfig, tier: MemoryTier,
                  dtype: WeightsDtype) -> int | None:
    """Fewest nodes with which the table's row-wise shard would fit (None if even 1024 nodes do not help)."""
    p = cfg.hardware.devices_per_node
    for nodes in (2**i for i in range(11)):
        if nodes <= cfg.hardware.nodes:
            continue
        bigger = dataclasses.replace(cost, topo=Topology(nodes, p))
        if bigger.piece(table, ShardingType.row_wise, tier, dtype, 1)[1].fits(bigger.capacity):
            return nodes
    return None


def check_total_memory(cfg: NeocfgConfig, cost: CostModel, options: list[list[ShardingOption]]) -> None:
    """The least memory every table needs (per tier, summed over devices) against the cluster's total."""
    w = cfg.hardware.num_devices
    need_hbm = sum(min(o.storage.hbm * o.num_pieces for o in opts) for opts in options)
    need_host = sum(min(o.storage.host * o.num_pieces for o in opts) for opts in options)
    need_any = sum(min((o.storage.hbm + o.storage.host) * o.num_pieces for o in opts) for opts in options)
    cap_hbm, cap_host = cost.hbm_capacity * w, cost.host_capacity * w
    per_node = (cost.hbm_capacity + cost.host_capacity) * cfg.hardware.devices_per_node
    if need_hbm > cap_hbm or need_host > cap_host or need_any > cap_hbm + cap_host:
        nodes = ceil_div(int(need_any), int(per_node)) if per_node else 0
        which, need, have = (("device memory (HBM)", need_hbm, cap_hbm) if need_hbm > cap_hbm else
                             ("host DDR", need_host, cap_host) if need_host > cap_host else
                             ("HBM + host DDR", need_any, cap_hbm + cap_host))
        fixes = []
        if WeightsDtype.fp16 not in cfg.planner.weights_dtypes:
            fixes.append("fp16 weights (planner.weights_dtypes=[fp32,fp16])")
        fixes.append(f"hardware.nodes>={max(nodes, cfg.hardware.nodes + 1)}")
        raise InfeasibleError(
            f"model {cfg.model.name} does not fit {cfg.hardware.name}: its tables need at least {_gib(need)} of"
            f" {which} in total, the {w} devices have {_gib(have)} usable; would fit with " + " or ".join(fixes))
