"""The collectives of a training step, as one list the planner prices and the runtime issues.

A table piece adds bytes to some of the step's collectives (`PieceComm`, from its Scheme's `piece_comms`: how its
ids arrive, by Routing; how its outputs leave and its gradients return, by OutputKind). The runtime batches every
piece of a kind into one collective, so a rank issues each collective once per step whatever the number of tables;
`step_collectives` adds up the pieces of a plan into each rank's list (`Collective`), with the collectives that no
piece owns: the id counts, the payload headers, the dense gradients (DDP's buckets, or riding in the backward
all-to-all) and the data-parallel replicas' gradient all-reduce.

Bytes are what a rank puts into (`sent`) and gets out of (`received`) the collective: an all-to-all's input and
output buffers, a reduce-scatter's whole input and its share, an all-gather's piece and the gathered whole, an
all-reduce's buffer (both). Ids are expectations where they depend on the data: a row-sharded table's ids are
counted evenly over its row ranges (the runtime's totals per sender are exact; what one range receives is not).

Process groups (`GroupScope`): world (every rank), intra_node (the ranks of one node: the two-level exchange's
reduce-scatter and all-gather, issued only on nodes holding such tables), cross_node (the ranks with the same local
index, one per node). `Carries` says which of the runtime's groups a collective runs on (neocfg.runtime.dist.Purpose:
ids on the ids group, or the ids_ahead group in the data source's prefetch thread; outputs and their gradients on
the exchange group and the node groups; the replicas' gradients on theirs; DDP's buckets on the default group).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from neocfg.plan import Collective
from neocfg.types import Carries, CollectiveKind, DenseGradSync, GroupScope, IdsExchange, RoutingEncoding

if TYPE_CHECKING:
    from neocfg.config.model import ModelConfig
    from neocfg.plan import Plan, StepStrategies

# Elements at the front of every destination's id payload (neocfg.runtime.routing.HEADER): the next batch's
# (ids, codes) counts; where some rank has several TBE groups, then the ids of each group.
ID_HEADER = 2
# The id counts travel as int64 (IdRouter.send's all-to-all of Routed.counts).
COUNT_BYTES = 8
FP32 = 4
# DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel): the first holds up to 1 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the others up to bucket_cap_mb (planner.costs.ddp_bucket_mib).
DDP_FIRST_BUCKET_BYTES = 1 << 20
# The exchange's reduce-scatters and all-gathers (the row-wise outputs' partial sums where they are reduce-scattered
# and their gradients, a node's two-level collectives): priced at a latency and a host rate of their own
# (hardware.reduce_scatter_latency_us, hardware.device.gather_copy_gbs).
GATHER_KINDS = (CollectiveKind.reduce_scatter, CollectiveKind.all_gather)


@dataclass(frozen=True)
class Traffic:
    """What a piece's bytes depend on besides its shape: the batch, the world and the plan's strategies."""

    batch_size: int                  # B, samples per rank
    world: int
    devices_per_node: int
    id_bytes: int                    # the plan's id dtype
    fwd_bytes: int                   # a2a_fwd_dtype
    bwd_bytes: int                   # a2a_bwd_dtype
    encoding: RoutingEncoding = RoutingEncoding.lengths
    sums_by_all_to_all: bool = False  # StepStrategies.sums_by_all_to_all

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    @property
    def nodes(self) -> int:
        return self.world // self.devices_per_node


@dataclass(frozen=True)
class PieceComm:
    """What one piece adds to one collective of the step: bytes its holder sends and receives in it, and bytes every
    rank of the world sends and receives in it on the piece's account (the other ends of an all-to-all; averaged
    over the world where only some ranks are the other end, so that they add up over pieces)."""

    kind: CollectiveKind
    group: GroupScope
    carries: Carries
    held_sent: float = 0.0
    held_received: float = 0.0
    each_sent: float = 0.0
    each_received: float = 0.0

    @property
    def held_bytes(self) -> float:
        """What the holder's link moves: the larger direction."""
        return max(self.held_sent, self.held_received)


# ---- what a piece adds: its ids by its routing, its outputs by its output kind ------------------------------------
def whole_table_ids(t: Traffic, pooling: float) -> PieceComm:
    """Every source sends the piece its [B] lengths and its B x L ids (a CW table once per slice)."""
    per_source = t.batch_size * (1 + pooling) * t.id_bytes
    return PieceComm(CollectiveKind.all_to_all, GroupScope.world, Carries.ids,
                     held_received=t.world * per_source, each_sent=per_source)


def by_row_ids(t: Traffic, pooling: float, share: float) -> PieceComm:
    """Each id goes to the range holding its row (`share` of the table's ids, evenly); lengths: [B] lengths per
    piece from every source; codes: one count per piece, and a bag code beside every id."""
    ids = t.batch_size * pooling * share
    if t.encoding is RoutingEncoding.codes:
        per_source = 1 + 2 * ids
    else:
        per_source = t.batch_size + ids
    per_source *= t.id_bytes
    return PieceComm(CollectiveKind.all_to_all, GroupScope.world, Carries.ids,
                     held_received=t.world * per_source, each_sent=per_source)


def all_to_all_outputs(t: Traffic, cols: int) -> tuple[PieceComm, ...]:
    """The piece's [B, cols] output for every rank out, their gradients back."""
    piece = t.batch_size * cols
    return (PieceComm(CollectiveKind.all_to_all, GroupScope.world, Carries.outputs,
                      held_sent=t.world * piece * t.fwd_bytes, each_received=piece * t.fwd_bytes),
            PieceComm(CollectiveKind.all_to_all, GroupScope.world, Carries.output_grads,
                      held_received=t.world * piece * t.bwd_bytes, each_sent=piece * t.bwd_bytes))


def reduce_scatter_outputs(t: Traffic, cols: int) -> tuple[PieceComm, ...]:
    """Partial sums of every global sample reduce-scattered over the world, or sent by an all-to-all to the rank of
    their samples and summed there (sums_by_all_to_all: every source's [B, cols] arrives); gradients all-gathered."""
    whole, share = t.global_batch * cols, t.batch_size * cols
    sums = (PieceComm(CollectiveKind.all_to_all, GroupScope.world, Carries.partial_sums,
                      held_sent=whole * t.fwd_bytes, held_received=whole * t.fwd_bytes) if t.sums_by_all_to_all
            else PieceComm(CollectiveKind.reduce_scatter, GroupScope.world, Carries.outputs,
                           held_sent=whole * t.fwd_bytes, held_received=share * t.fwd_bytes))
    return (sums,
            PieceComm(CollectiveKind.all_gather, GroupScope.world, Carries.output_grads,
                      held_sent=share * t.bwd_bytes, held_received=whole * t.bwd_bytes))


def hierarchical_outputs(t: Traffic, cols: int) -> tuple[PieceComm, ...]:
    """Partial sums reduce-scattered inside the node (each local rank keeps the samples of its counterparts on every
    node), then one all-to-all among the counterparts; backward the reverse (all-to-all, node all-gather)."""
    p, n, b = t.devices_per_node, t.nodes, t.batch_size
    whole, mine = t.global_batch * cols, n * b * cols
    fwd, bwd = t.fwd_bytes, t.bwd_bytes
    return (PieceComm(CollectiveKind.reduce_scatter, GroupScope.intra_node, Carries.outputs,
                      held_sent=whole * fwd, held_received=mine * fwd),
            PieceComm(CollectiveKind.all_to_all, GroupScope.cross_node, Carries.outputs,
                      held_sent=mine * fwd, each_received=b * cols / p * fwd),
            PieceComm(CollectiveKind.all_to_all, GroupScope.cross_node, Carries.output_grads,
                      held_received=mine * bwd, each_sent=b * cols / p * bwd),
            PieceComm(CollectiveKind.all_gather, GroupScope.intra_node, Carries.output_grads,
                      held_sent=mine * bwd, held_received=whole * bwd))


def replica_grads(table_bytes: float) -> tuple[PieceComm, ...]:
    """A data-parallel replica's fp32 table gradient, in the one all-reduce of every replica."""
    return (PieceComm(CollectiveKind.all_reduce, GroupScope.world, Carries.replica_grads,
                      held_sent=table_bytes, held_received=table_bytes),)


# What a piece's outputs add, by output kind (replicated: its gradient, replica_grads).
OUTPUTS = {"all_to_all": all_to_all_outputs, "reduce_scatter": reduce_scatter_outputs,
           "hierarchical": hierarchical_outputs}
_PROBE = Traffic(batch_size=1, world=1, devices_per_node=1, id_bytes=4, fwd_bytes=4, bwd_bytes=4)


def output_collective_kinds(kind_name: str, sums_by_all_to_all: bool = False) -> tuple[CollectiveKind, ...]:
    """The collectives per step the pieces of an output kind add (all pieces of a kind share them), by kind: one per
    distinct collective its records name (all_to_all 2, reduce_scatter 2, hierarchical 4, replicated 1)."""
    probe = replace(_PROBE, sums_by_all_to_all=sums_by_all_to_all)
    records = OUTPUTS[kind_name](probe, 1) if kind_name in OUTPUTS else replica_grads(1.0)
    return tuple(k for k, _, _ in dict.fromkeys((r.kind, r.group, r.carries) for r in records))


def output_collectives(kind_name: str) -> int:
    """Collectives per step the pieces of an output kind add (output_collective_kinds)."""
    return len(output_collective_kinds(kind_name))


def id_collectives(pipeline: bool, ahead: bool, weighted: bool = False) -> int:
    """Id collectives in a step: the counts, then the payload (and its weights' payload where the data has per-id
    weights); the pipelined step's counts ride in the previous payload's headers; ids exchanged a batch ahead in the
    prefetch thread leave none in the step."""
    if ahead:
        return 0
    return (1 if pipeline else 2) + (1 if weighted else 0)


# Values below this travel as int32: offsets of the ids of one step too must fit (2^31 - 1 ids).
ID32_LIMIT = 2**31 - 1
# The lengths encoding sends (row ranges x row-sharded tables x B) lengths per step, the codes encoding does a few
# passes per row-sharded id. Measured (bench/bench_routing.py --rw 856 --encodings lengths,codes, one thread, int32
# ids, prod_856 ids, route + worst receive) at 0.35 / 0.71 / 1.41 / 2.82 / 5.65 / 11.3 length entries per id
# (worlds 2..64, all tables row-wise): lengths 13.9 / 15.9 / 17.2 / 25.6 / 53.4 / 501 ms, codes 36.9 / 33.5 / 27.5 /
# 29.6 / 38.8 / 60.3 ms; at 18 (128 ranks, 100 tables row-wise) route 27 vs 5.3 ms. The crossover lies near 3.4
# (linear between 2.82 and 5.65).
LENGTH_ENTRIES_PER_ID = 3.0


def encoding_for(ranges: float, ids_per_sample: float) -> RoutingEncoding:
    """The routing encoding of row-sharded ids: ranges x tables length entries per sample against their ids."""
    return RoutingEncoding.lengths if ranges <= LENGTH_ENTRIES_PER_ID * ids_per_sample else RoutingEncoding.codes


# ---- a plan's step, rank by rank ---------------------------------------------------------------------------------
def ddp_bucket_bytes(grad_bytes: int, bucket_mib: float) -> tuple[int, ...]:
    """The bytes of each all-reduce DDP issues per step for this many bytes of dense gradients, in the order their
    gradients are ready: the first bucket up to DDP_FIRST_BUCKET_BYTES, the others up to bucket_mib (parameters
    taken as divisible)."""
    if grad_bytes <= 0:
        return ()
    first = min(grad_bytes, DDP_FIRST_BUCKET_BYTES)
    rest, cap = grad_bytes - first, int(bucket_mib * 2**20)
    return (first,) + tuple(min(cap, rest - i * cap) for i in range(math.ceil(rest / cap) if rest > 0 else 0))


def ddp_buckets(grad_bytes: int, bucket_mib: float) -> int:
    """All-reduces DDP issues per step for this many bytes of dense gradients."""
    return len(ddp_bucket_bytes(grad_bytes, bucket_mib))


def plan_traffic(plan: "Plan", strategies: "StepStrategies") -> Traffic:
    return Traffic(batch_size=plan.batch_size_per_device, world=plan.world_size,
                   devices_per_node=plan.devices_per_node, id_bytes=strategies.id_dtype.bytes,
                   fwd_bytes=plan.a2a_fwd_dtype.bytes, bwd_bytes=plan.a2a_bwd_dtype.bytes,
                   encoding=strategies.routing_encoding, sums_by_all_to_all=strategies.sums_by_all_to_all)


def step_collectives(plan: "Plan", model: "ModelConfig", dense_params: int,
                     ddp_bucket_mib: float = 25.0) -> tuple[tuple[Collective, ...], ...]:
    """Every rank's collectives per step (steady state: the pipelined step's first step also exchanges the counts)
    for a plan with its strategies, in the runtime's order; dense_params: the dense part's parameters (the DDP
    all-reduce, or the riders of the backward all-to-all)."""
    from neocfg.sharding import SCHEMES, OutputKind, PieceShape, Routing

    st = plan.strategies
    if st is None:
        raise ValueError("step_collectives: the plan has no strategies (neocfg.planner.strategies.with_strategies)")
    world, per = plan.world_size, plan.devices_per_node
    pooling = {t.name: t.pooling_factor for t in model.tables}
    by_row = any(SCHEMES[t.sharding].routing is Routing.by_row for t in plan.tables)
    # nothing row-sharded: the router sends whole-table lengths and ids whatever the encoding says
    traffic = plan_traffic(plan, st if by_row else replace(st, routing_encoding=RoutingEncoding.lengths))
    held: list[dict] = [defaultdict(lambda: [0.0, 0.0]) for _ in range(world)]
    each: dict = defaultdict(lambda: [0.0, 0.0])
    present: set = set()
    groups: list[set] = [set() for _ in range(world)]
    for t in plan.tables:
        scheme = SCHEMES[t.sharding]
        kind = scheme.output_kind([s.rank for s in t.shards], world, per)
        for s in t.shards:
            if kind is not OutputKind.replicated:
                groups[s.rank].add((t.weights_dtype, t.memory))
            shape = PieceShape(rows=s.num_rows, cols=s.num_cols, lookup_rows=0.0, output_samples=0.0)
            for pc in scheme.piece_comms(traffic, shape, pooling[t.name], kind,
                                         share=s.num_rows / t.num_embeddings):
                key = (pc.kind, pc.group, pc.carries)
                present.add(key)
                held[s.rank][key][0] += pc.held_sent
                held[s.rank][key][1] += pc.held_received
                each[key][0] += pc.each_sent
                each[key][1] += pc.each_received
    # the id payload: every rank sends every destination a header, pieces or not
    header = ID_HEADER + (max(len(g) for g in groups) if max(len(g) for g in groups) > 1 else 0)
    ids_key = (CollectiveKind.all_to_all, GroupScope.world, Carries.ids)
    present.add(ids_key)
    ahead = st.ids_exchange is IdsExchange.prefetch
    fold = st.dense_grad_sync is DenseGradSync.exchange
    out = []
    for r in range(world):
        node_holds = {k for q in range(r - r % per, r - r % per + per) for k in held[q]}
        rank: list[Collective] = []

        def add(key, count=1, sent=0.0, received=0.0, overlapped=False):
            h, e = held[r].get(key, (0.0, 0.0)), each.get(key, (0.0, 0.0))
            rank.append(Collective(*key, count=count, sent=h[0] + e[0] + sent, received=h[1] + e[1] + received,
                                   overlapped=overlapped))

        if id_collectives(st.pipeline, ahead) != 1:   # (pipelined: counts in the previous payload's headers)
            counts = world * header * COUNT_BYTES
            add((CollectiveKind.all_to_all, GroupScope.world, Carries.id_counts), sent=counts, received=counts,
                overlapped=ahead)
        head = world * header * traffic.id_bytes
        add(ids_key, sent=head, received=head, overlapped=ahead or st.pipeline)
        if st.id_weights:   # a float32 payload of the same split sizes (routing.py: IdRouter.send)
            ids = rank[-1]
            scale = FP32 / traffic.id_bytes
            rank.append(Collective(CollectiveKind.all_to_all, GroupScope.world, Carries.id_weights, count=1,
                                   sent=ids.sent * scale, received=ids.received * scale, overlapped=ids.overlapped))
        for key in _ORDER:
            if key not in present:
                continue
            if key[1] is GroupScope.intra_node and key not in node_holds:   # a node without such tables
                continue
            rider = world * dense_params * FP32 if fold and key == _A2A_GRADS else 0.0
            add(key, sent=rider, received=rider, overlapped=st.output_overlap and key in _BESIDE_BOTTOM_MLP)
        if not fold and dense_params:
            grads = dense_params * FP32
            add((CollectiveKind.all_reduce, GroupScope.world, Carries.dense_grads),
                count=ddp_buckets(grads, ddp_bucket_mib), sent=grads, received=grads, overlapped=True)
        out.append(tuple(rank))
    return tuple(out)


_A2A_GRADS = (CollectiveKind.all_to_all, GroupScope.world, Carries.output_grads)
_A2A_OUTPUTS = (CollectiveKind.all_to_all, GroupScope.world, Carries.outputs)
# What travels while the bottom MLP runs under StepStrategies.output_overlap: the outputs' all-to-all forward, its
# gradients' backward (the other kinds' collectives are waited for at once).
_BESIDE_BOTTOM_MLP = (_A2A_OUTPUTS, _A2A_GRADS)
# The order a step issues them in (forward: EmbeddingExchange.forward; backward: the exchange's backward, then the
# replicas' all-reduce as their gradient completes; DDP's buckets interleave with backward on their own group).
_ORDER = (
    _A2A_OUTPUTS,
    (CollectiveKind.all_to_all, GroupScope.world, Carries.partial_sums),
    (CollectiveKind.reduce_scatter, GroupScope.world, Carries.outputs),
    (CollectiveKind.reduce_scatter, GroupScope.intra_node, Carries.outputs),
    (CollectiveKind.all_to_all, GroupScope.cross_node, Carries.outputs),
    _A2A_GRADS,
    (CollectiveKind.all_gather, GroupScope.world, Carries.output_grads),
    (CollectiveKind.all_to_all, GroupScope.cross_node, Carries.output_grads),
    (CollectiveKind.all_gather, GroupScope.intra_node, Carries.output_grads),
    (CollectiveKind.all_reduce, GroupScope.world, Carries.replica_grads),
)


def describe(collectives: Iterable[Collective]) -> str:
    """One line: count x kind (group, what) sent bytes."""
    return "; ".join(f"{c.count} {c.kind.value} {c.group.value} {c.carries.value} {round(c.sent):,} B"
                     + (" (overlapped)" if c.overlapped else "") for c in collectives)


def collective_count(collectives: Sequence[Collective], overlapped: Optional[bool] = None) -> int:
    """Collectives per step (those overlapped or exposed only, when asked)."""
    return sum(c.count for c in collectives if overlapped is None or c.overlapped is overlapped)
