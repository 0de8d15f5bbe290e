"""Input and output distribution of the sharded embeddings.

Forward: the ids of every local sample go to the ranks that look them up (neocfg.runtime.routing); the pooled
outputs come back by all-to-all (TW/CW/TWCW pieces, RW pieces off the whole world), reduce-scatter (RW partial
sums) and the two-level exchange (TWRW); data-parallel replicas are not exchanged (neocfg.runtime.replicated). Backward runs the reverse collectives in EmbeddingExchange.backward, in a fixed order on
every rank, on a process group of its own (so DDP's asynchronous all-reduces of the dense gradients never interleave
with them). Pooled outputs and their gradients travel in plan.a2a_fwd_dtype / a2a_bwd_dtype.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from neocfg.runtime.layout import Layout, OutputKind
from neocfg.runtime.timing import StepTimes, Stopwatch  # noqa: F401  (re-exported)
from neocfg.types import CommDtype

TORCH_DTYPES = {CommDtype.fp32: torch.float32, CommDtype.fp16: torch.float16, CommDtype.bf16: torch.bfloat16}


@dataclass
class Comm:
    """The embedding process group and this rank's place in it."""

    group: object
    rank: int
    world: int
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)

    def all_to_all(self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = send.new_empty(sum(out_splits))
        dist.all_to_all_single(out, send.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def all_to_all_async(self, send: torch.Tensor, out_splits: list[int],
                         in_splits: list[int]) -> tuple[torch.Tensor, Any]:
        """The all-to-all sent without waiting: its receive buffer and the work to wait on before reading it."""
        out = send.new_empty(sum(out_splits))
        work = dist.all_to_all_single(out, send.contiguous(), out_splits, in_splits, group=self.group, async_op=True)
        return out, work

    def sum_scatter(self, send: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """send: [world, n] -> the sum over ranks of send[rank], in `dtype`: a reduce-scatter made of an all-to-all
        (the same bytes; gloo's reduce_scatter takes 1.6-2.5x as long: bench/bench_gloo_collectives.py) and the sum of
        what arrived."""
        n = send.shape[1]
        got = self.all_to_all(send.reshape(-1), [n] * self.world, [n] * self.world)
        return got.view(self.world, n).to(dtype).sum(0)

    def reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        """send: [world, n] -> the sum over ranks of send[rank]."""
        out = send.new_empty(send.shape[1:])
        dist.reduce_scatter_single(out.view(-1), send.contiguous().view(-1), group=self.group)
        return out

    def all_gather(self, piece: torch.Tensor) -> torch.Tensor:
        out = piece.new_empty((self.world * piece.shape[0], *piece.shape[1:]))
        dist.all_gather_single(out, piece.contiguous(), group=self.group)
        return out.view(self.world, *piece.shape)


class Purpose(enum.Enum):
    """What a process group of its own carries (collectives of different purposes may be in flight at once, each
    must pair up with the same purpose on every rank, so none shares a group with another)."""

    exchange = enum.auto()    # the embeddings' output exchange (forward and backward), losses, checkpoints
    ids = enum.auto()         # the step's id all-to-alls (the pipelined step's are in flight beside the exchange)
    ids_ahead = enum.auto()   # ids exchanged in the data source's prefetch thread
    replicas = enum.auto()    # the data-parallel tables' gradient all-reduce


_groups: dict[Purpose, object] = {}
_groups_world: list[object] = [None]   # the default group they were made in


def purpose_group(purpose: Purpose, timeout: datetime.timedelta) -> object:
    """The process group of `purpose` over every rank: created at its first use in this process's default group
    and reused after (each is an NCCL communicator on GPUs; a second Trainer in the same group makes none).
    Collective the first time: every rank asks for the same purposes in the same order."""
    if _groups_world[0] is not dist.group.WORLD:   # a new default group: the old groups went with the old one
        _groups.clear()
        _groups_world[0] = dist.group.WORLD
    if purpose not in _groups:
        _groups[purpose] = dist.new_group(backend=dist.get_backend(), timeout=timeout)
    return _groups[purpose]


# ---------------------------------------------------------------- pooled outputs: owners -> source ranks


@dataclass
class NodeComms:
    """Groups of the two-level (hierarchical) exchange: this rank's node, and the ranks of its local index."""

    node: Comm
    cross: Comm

    @staticmethod
    def build(world: int, rank: int, devices_per_node: int, timeout: datetime.timedelta) -> "NodeComms":
        """Collective: every rank creates every group, in the same order."""
        per, nodes = devices_per_node, world // devices_per_node
        kw = {"backend": dist.get_backend(), "timeout": timeout}
        node_groups = [dist.new_group(list(range(n * per, (n + 1) * per)), **kw) for n in range(nodes)]
        cross_groups = [dist.new_group([m * per + j for m in range(nodes)], **kw) for j in range(per)]
        return NodeComms(node=Comm(node_groups[rank // per], rank % per, per),
                         cross=Comm(cross_groups[rank % per], rank // per, nodes))


@dataclass
class ExchangePlan:
    """Static description of the output exchange for this rank (built once from the layout)."""

    comm: Comm
    batch_size: int
    total_dim: int
    a2a_widths: list[int]           # all_to_all columns held by each rank
    a2a_target: torch.Tensor        # output columns of the received all_to_all pieces (source-major)
    rs_target: torch.Tensor
    hier_target: torch.Tensor
    hier_widths: list[int]          # hierarchical columns of each node
    node_comms: Optional[NodeComms]
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    grad_scale: float               # 1/world: the global loss is the mean over the global batch
    sums_by_all_to_all: bool        # the reduce-scatter part by all-to-all, summed here (StepStrategies)
    stopwatch: Stopwatch
    # The received elements' places in the output ([B, sum of the pieces' columns] by _piece_gather, then
    # a2a_target) composed and cut into runs of contiguous elements (ChunkGather): received all_to_all elements
    # (and one zero run) -> the whole [B, total_dim] output; the flat output gradient -> the order the all_to_all
    # sends. One gather each way instead of a zero fill, two index ops and an index_add.
    a2a_to_out: Optional["ChunkGather"] = None
    out_to_a2a: Optional["ChunkGather"] = None

    @staticmethod
    def build(layout: Layout, comm: Comm, batch_size: int, fwd: CommDtype, bwd: CommDtype,
              stopwatch: Stopwatch, sums_by_all_to_all: bool = False) -> "ExchangePlan":
        hier = layout.target_columns(OutputKind.hierarchical)
        node_comms = (NodeComms.build(comm.world, comm.rank, layout.devices_per_node, comm.timeout)
                      if hier.numel() else None)
        widths = [r.width(OutputKind.all_to_all) for r in layout.ranks]
        gather = _piece_gather(batch_size, widths)
        target = layout.target_columns(OutputKind.all_to_all)
        a2a_to_out = out_to_a2a = None
        if target.numel():
            a, total, n_recv = len(target), layout.total_dim, batch_size * sum(widths)
            out_pos = (torch.arange(batch_size).repeat_interleave(a) * total + target.repeat(batch_size))
            src_of_out = torch.full((batch_size * total,), n_recv, dtype=torch.long)   # n_recv: the zero run
            src_of_out[out_pos] = gather
            scatter = torch.argsort(gather)
            a2a_to_out = ChunkGather.build(src_of_out, n_recv, zero_run=True)
            out_to_a2a = ChunkGather.build(out_pos.index_select(0, scatter), batch_size * total)
        return ExchangePlan(
            comm=comm, batch_size=batch_size, total_dim=layout.total_dim,
            a2a_widths=widths, a2a_target=target,
            rs_target=layout.target_columns(OutputKind.reduce_scatter),
            hier_target=hier, hier_widths=layout.hierarchical_widths(), node_comms=node_comms,
            fwd_dtype=TORCH_DTYPES[fwd], bwd_dtype=TORCH_DTYPES[bwd], grad_scale=1.0 / comm.world,
            sums_by_all_to_all=sums_by_all_to_all,
            stopwatch=stopwatch, a2a_to_out=a2a_to_out, out_to_a2a=out_to_a2a)

    def to(self, device: torch.device) -> "ExchangePlan":
        """The plan with its index tensors on `device`."""
        moved = {name: getattr(self, name).to(device)
                 for name in ("a2a_target", "rs_target", "hier_target")}
        chunks = {name: getattr(self, name).to(device) if getattr(self, name) is not None else None
                  for name in ("a2a_to_out", "out_to_a2a")}
        return dataclasses.replace(self, **moved, **chunks)


# Run lengths ChunkGather tries, longest first (embedding dims and column slices are multiples of 4 in practice).
CHUNK_RUNS = (128, 64, 32, 16, 8, 4, 2)


@dataclass
class ChunkGather:
    """out = src[index] for a flat element map `index`, done as a gather of runs of `run` contiguous elements
    (src viewed as [n / run, run]: one index per run, each a memcpy of run elements): the longest run in CHUNK_RUNS
    such that the map is made of aligned runs, else elementwise. zero_run: index value `src_numel` stands for a
    zero (a run of zeros is appended to src)."""

    run: int
    index: torch.Tensor
    zero_run: bool

    @staticmethod
    def build(index: torch.Tensor, src_numel: int, zero_run: bool = False) -> "ChunkGather":
        pos = torch.arange(index.numel())
        zero = index >= src_numel if zero_run else None
        for run in CHUNK_RUNS:
            if index.numel() % run or src_numel % run:
                continue
            # a zero at position p is element p % run of the appended zero run
            v = (index if zero is None else torch.where(zero, src_numel + pos % run, index)).view(-1, run)
            if bool((v[:, 0] % run == 0).all()) and bool((v == v[:, :1] + torch.arange(run)).all()):
                return ChunkGather(run, v[:, 0] // run, zero_run)
        return ChunkGather(1, index if zero is None else index.clamp(max=src_numel), zero_run)

    def to(self, device: torch.device) -> "ChunkGather":
        return dataclasses.replace(self, index=self.index.to(device))

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        if self.zero_run:
            src = torch.cat([src.reshape(-1), src.new_zeros(self.run)])
        return src.reshape(-1, self.run).index_select(0, self.index).view(-1)


class EmbeddingExchange(torch.autograd.Function):
    """(a2a_part [W,B,A], rs_part [W,B,R], hier_part [W,B,H]) on the owners -> pooled [B, sum dims] on the sources
    (zeros in the columns of data-parallel tables).

    rider (optional, needs an all-to-all part): the dense gradients (neocfg.runtime.dlrm.DenseGrads), complete when
    this backward runs (the caller's job); they travel in the backward all-to-all, appended to every destination's
    piece as raw fp32 bits whatever a2a_bwd_dtype, and come back averaged over ranks: no all-reduce of their own."""

    @staticmethod
    def forward(ctx, xp: ExchangePlan, rider, a2a_part: torch.Tensor, rs_part: torch.Tensor,
                hier_part: torch.Tensor) -> torch.Tensor:
        if rider is not None and xp.out_to_a2a is None:
            raise ValueError("EmbeddingExchange: dense gradients can only ride in an all-to-all")
        ctx.xp, ctx.rider = xp, rider
        comm, b = xp.comm, xp.batch_size
        with xp.stopwatch("comm_fwd"):
            if xp.a2a_to_out is not None:
                me = xp.a2a_widths[comm.rank]
                recv = comm.all_to_all(a2a_part.to(xp.fwd_dtype).reshape(-1), [b * w for w in xp.a2a_widths],
                                       [b * me] * comm.world).to(a2a_part.dtype)
                out = xp.a2a_to_out(recv).view(b, xp.total_dim)    # zeros in the other kinds' columns
            else:
                out = a2a_part.new_zeros((b, xp.total_dim))
            _add_other_kinds(xp, out, rs_part, hier_part)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xp: ExchangePlan = ctx.xp
        comm, b = xp.comm, xp.batch_size
        g = grad_out * xp.grad_scale
        grads = [None, None, None, None, None]
        with xp.stopwatch("comm_bwd"):
            if xp.out_to_a2a is not None:
                send = xp.out_to_a2a(g).to(xp.bwd_dtype)    # [B, total_dim] -> source-major pieces
                me = xp.a2a_widths[comm.rank]
                mine, theirs = [b * me] * comm.world, [b * w for w in xp.a2a_widths]
                if ctx.rider is None:
                    recv = comm.all_to_all(send, mine, theirs)
                    grads[2] = recv.to(g.dtype).view(comm.world, b, me)
                else:
                    extra = ctx.rider.flat.view(xp.bwd_dtype)       # the fp32 bits, in wire-dtype elements
                    k = extra.numel()
                    send = torch.cat([t for piece in send.split(theirs) for t in (piece, extra)])
                    recv = comm.all_to_all(send, [n + k for n in mine], [n + k for n in theirs])
                    recv = recv.view(comm.world, b * me + k)
                    ctx.rider.average(recv[:, b * me:].contiguous().view(torch.float32))
                    grads[2] = recv[:, :b * me].to(g.dtype).reshape(comm.world, b, me)
            grads[3], grads[4] = _other_kinds_grads(xp, g)
        return tuple(grads)


class PendingPooled:
    """Pooled outputs whose all-to-all is still in flight (ShardedEmbeddings.forward(..., pending=True)), so that
    the caller computes what does not need them meanwhile (the bottom MLP: DenseArch.forward waits only at the
    interaction); wait() finishes the exchange and returns them. The backward mirrors it: ExchangeFinish.backward
    sends the gradients' all-to-all, the bottom MLP's backward runs while it travels (autograd runs the node made
    last first), ExchangeStart.backward waits for it. wait_marks: when wait() began and ended (its lap is
    comm_fwd; the caller takes it out of a span that contains it). Not a dataclass: DDP passes it through as is."""

    def __init__(self, xp: ExchangePlan, recv: torch.Tensor, rs_part: torch.Tensor, hier_part: torch.Tensor,
                 then=None) -> None:
        self.xp, self.recv, self.rs_part, self.hier_part, self.then = xp, recv, rs_part, hier_part, then
        self.work = self.send = None              # the forward all-to-all in flight (ExchangeStart)
        self.bwd_work = self.bwd_recv = None      # the backward's (ExchangeFinish.backward)
        self.wait_marks = None
        self.done: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self.done is None:
            sw = self.xp.stopwatch
            t0 = sw.now()
            out = ExchangeFinish.apply(self.xp, self, self.recv, self.rs_part, self.hier_part)
            self.recv = self.rs_part = self.hier_part = None
            t1 = sw.now()
            sw.span("comm_fwd", t0, t1)
            self.wait_marks = (t0, t1)
            self.done = self.then(out) if self.then is not None else out
        return self.done


class ExchangeStart(torch.autograd.Function):
    """a2a_part [W,B,A] -> the receive buffer of its all-to-all, sent without waiting (PendingPooled). Backward:
    waits for the gradients' all-to-all that ExchangeFinish.backward sent."""

    @staticmethod
    def forward(ctx, xp: ExchangePlan, pending: PendingPooled, a2a_part: torch.Tensor) -> torch.Tensor:
        ctx.xp, ctx.pending, ctx.dtype = xp, pending, a2a_part.dtype
        comm, b = xp.comm, xp.batch_size
        with xp.stopwatch("comm_fwd"):
            pending.send = a2a_part.to(xp.fwd_dtype).reshape(-1).contiguous()
            recv, pending.work = comm.all_to_all_async(pending.send, [b * w for w in xp.a2a_widths],
                                                       [b * xp.a2a_widths[comm.rank]] * comm.world)
        return recv

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        xp, pending = ctx.xp, ctx.pending
        comm, b = xp.comm, xp.batch_size
        with xp.stopwatch("comm_bwd"):
            pending.bwd_work.wait()
            recv, pending.bwd_work, pending.bwd_recv = pending.bwd_recv, None, None
        return None, None, recv.to(ctx.dtype).view(comm.world, b, xp.a2a_widths[comm.rank])


class ExchangeFinish(torch.autograd.Function):
    """(the receive buffer of ExchangeStart's all-to-all, rs_part, hier_part) -> pooled [B, sum dims], waiting for
    the all-to-all first; the reduce-scatter and two-level parts as in EmbeddingExchange. Backward: the gradients'
    all-to-all sent without waiting (ExchangeStart.backward waits), then the other kinds' collectives."""

    @staticmethod
    def forward(ctx, xp: ExchangePlan, pending: PendingPooled, recv: torch.Tensor, rs_part: torch.Tensor,
                hier_part: torch.Tensor) -> torch.Tensor:
        ctx.xp, ctx.pending = xp, pending
        comm, b = xp.comm, xp.batch_size
        pending.work.wait()
        pending.work = pending.send = None
        out = xp.a2a_to_out(recv.to(rs_part.dtype)).view(b, xp.total_dim)
        _add_other_kinds(xp, out, rs_part, hier_part)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xp, pending = ctx.xp, ctx.pending
        comm, b = xp.comm, xp.batch_size
        g = grad_out * xp.grad_scale
        with xp.stopwatch("comm_bwd"):
            send = xp.out_to_a2a(g).to(xp.bwd_dtype)    # the gradient of the receive buffer, in wire dtype
            me = xp.a2a_widths[comm.rank]
            pending.bwd_recv, pending.bwd_work = comm.all_to_all_async(send, [b * me] * comm.world,
                                                                       [b * w for w in xp.a2a_widths])
            rs, hier = _other_kinds_grads(xp, g)
        return None, None, send, rs, hier


def _add_other_kinds(xp: ExchangePlan, out: torch.Tensor, rs_part: torch.Tensor, hier_part: torch.Tensor) -> None:
    """out += the reduce-scatter and two-level parts' pooled outputs (their collectives)."""
    comm, b = xp.comm, xp.batch_size
    if xp.rs_target.numel():
        send = rs_part.to(xp.fwd_dtype).reshape(comm.world, -1)
        if xp.sums_by_all_to_all:
            summed = comm.sum_scatter(send, out.dtype)
        else:
            summed = comm.reduce_scatter(send).to(out.dtype)
        out.index_add_(1, xp.rs_target, summed.view(b, -1))
    if xp.hier_target.numel():
        out.index_add_(1, xp.hier_target, _hier_forward(xp, hier_part.to(xp.fwd_dtype)).to(out.dtype))


def _other_kinds_grads(xp: ExchangePlan, g: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The reduce-scatter and two-level parts' gradients from the scaled output gradient g (their collectives)."""
    comm = xp.comm
    rs = hier = None
    if xp.rs_target.numel():
        rs = comm.all_gather(g.index_select(1, xp.rs_target).to(xp.bwd_dtype)).to(g.dtype)
    if xp.hier_target.numel():
        got = _hier_backward(xp, g.index_select(1, xp.hier_target).to(xp.bwd_dtype))
        hier = got.to(g.dtype) if got is not None else None
    return rs, hier


def _piece_gather(b: int, widths: list[int]) -> torch.Tensor:
    """Received all_to_all elements are source-major [s][B][w_s]; element j of the flat [B, sum w] output is
    received element gather[j]."""
    w = torch.tensor(widths, dtype=torch.long)
    starts = torch.cumsum(b * w, 0) - b * w
    # per output column: its source's first element, its source's width and its place in that width
    col_start, col_width = starts.repeat_interleave(w), w.repeat_interleave(w)
    col_in = torch.arange(int(w.sum())) - (torch.cumsum(w, 0) - w).repeat_interleave(w)
    return (col_start + col_in + torch.arange(b).view(-1, 1) * col_width).reshape(-1)


def _hier_forward(xp: ExchangePlan, part: torch.Tensor) -> torch.Tensor:
    """[W, B, C] partial sums of this node's TWRW tables -> [B, sum over nodes of C] for this rank's samples."""
    nc, b = xp.node_comms, xp.batch_size
    nodes, per = nc.cross.world, nc.node.world
    width = xp.hier_widths[nc.cross.rank]
    if width:  # sum over the node's owners; local rank j keeps the samples of the sources with local index j
        by_dest = part.view(nodes, per, b, width).transpose(0, 1).reshape(per, -1)
        mine = nc.node.reduce_scatter(by_dest)                                  # [nodes * B * C]
    else:
        mine = part.new_zeros(0)
    recv = nc.cross.all_to_all(mine, [b * w for w in xp.hier_widths], [b * width] * nodes)
    pieces = [p.view(b, w) for p, w in zip(recv.split([b * w for w in xp.hier_widths]), xp.hier_widths)]
    return torch.cat(pieces, dim=1)


def _hier_backward(xp: ExchangePlan, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """Reverse of _hier_forward: [B, sum C] gradients -> [W, B, C] for this node's owners."""
    nc, b = xp.node_comms, xp.batch_size
    nodes, per = nc.cross.world, nc.node.world
    width = xp.hier_widths[nc.cross.rank]
    send = torch.cat([p.reshape(-1) for p in grad.split(xp.hier_widths, dim=1)])
    recv = nc.cross.all_to_all(send, [b * width] * nodes, [b * w for w in xp.hier_widths])
    if not width:
        return None
    full = nc.node.all_gather(recv)                                             # [per, nodes * B * C]
    return full.view(per, nodes, b, width).transpose(0, 1).reshape(nodes * per, b, width)
