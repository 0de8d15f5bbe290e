"""This rank's embedding shards: one fused fbgemm TBE per (weights precision, memory tier) group, the sparse
optimizer fused into its backward, fed by the id exchange and returning through EmbeddingExchange."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Union

import torch
from torch import nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

from neocfg.batch import Batch
from neocfg.config.train import TrainConfig
from neocfg.errors import DataError
from neocfg.runtime.dist import Comm, EmbeddingExchange, ExchangePlan, ExchangeStart, PendingPooled, Stopwatch
from neocfg.runtime.layout import GroupKey, Layout, LocalShard, OutputKind
from neocfg.runtime.init_weights import INIT_BLOCK_ROWS, init_rows  # noqa: F401  (re-exported)
from neocfg.runtime.replicated import ReplicatedEmbeddings
from neocfg.runtime.routing import Exchanged, IdRouter, LocalLookups, PendingIds, Routed, RwEncoding
from neocfg.runtime.timing import BackwardMark

# The output kinds EmbeddingExchange carries, in the order of its inputs (data-parallel replicas stay local).
EXCHANGED = (OutputKind.all_to_all, OutputKind.reduce_scatter, OutputKind.hierarchical)
from neocfg.tiers import TIERS
from neocfg.types import CommDtype, MemoryTier, SparseOptimizer, WeightsDtype

FUSED_OPTIMIZERS = {
    SparseOptimizer.exact_rowwise_adagrad: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    SparseOptimizer.exact_adagrad: EmbOptimType.EXACT_ADAGRAD,
    SparseOptimizer.exact_sgd: EmbOptimType.EXACT_SGD,
}
WEIGHTS_PRECISION = {WeightsDtype.fp32: SparseType.FP32, WeightsDtype.fp16: SparseType.FP16}
# Where a tier's rows live on a GPU (on CPU every tier is host memory): HBM; UVM with an HBM cache; UVM only.
GPU_LOCATION = {tier: EmbeddingLocation[t.fbgemm_location] for tier, t in TIERS.items()}
# fbgemm's default fraction of UVM rows cached in HBM, used when the plan gives none.
DEFAULT_CACHE_LOAD_FACTOR = 0.2
# fbgemm's CPU backward applies row-wise Adagrad with a JIT kernel to every table that has one feature, and with its
# generic loop (the same update) to a table that has several. On some CPUs the JIT kernel is far the slower: on an
# Intel Xeon (AVX-512) it took ~600 ns per updated row (20,480 rows of dim 16: 12-17 ms, the generic loop 0.9 ms;
# prod_856's tables x2.6, one rank: 474 -> 113 ms backward), where on the AMD EPYC bench/RESULTS.md records it was
# the fast one. A twinned TBE gives each table a second, always empty feature so that the generic loop runs;
# generic_update_faster() measures which is faster on this CPU, once per process and dim.
TWIN_PROBE_ROWS = 4096     # rows updated per probe backward (the JIT kernel takes blocks of 64)
TWIN_PROBE_REPEATS = 3     # the fastest of these backwards counts, for each kind


def _tbe(shard_shapes: list[tuple[int, int]], key: GroupKey, train: TrainConfig, device: torch.device,
         cache_ratio: float, twin: bool) -> SplitTableBatchedEmbeddingBagsCodegen:
    if device.type == "cuda":
        loc, compute = GPU_LOCATION[key.tier], ComputeDevice.CUDA
    else:
        loc, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    specs = [(max(1, rows), cols, loc, compute) for rows, cols in shard_shapes]
    kw = dict(optimizer=FUSED_OPTIMIZERS[train.sparse_optimizer], learning_rate=train.sparse_learning_rate,
              weights_precision=WEIGHTS_PRECISION[key.dtype], stochastic_rounding=True, pooling_mode=PoolingMode.SUM,
              cache_load_factor=cache_ratio or DEFAULT_CACHE_LOAD_FACTOR, device=device)
    return TwinnedTBE(specs, **kw) if twin else SplitTableBatchedEmbeddingBagsCodegen(specs, **kw)


def make_tbe(shard_shapes: list[tuple[int, int]], key: GroupKey, train: TrainConfig, device: torch.device,
             cache_ratio: float = 0.0, twin: Optional[bool] = None) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One fused TBE over (rows, cols) shards; empty row ranges get one never-addressed row (fbgemm needs >= 1).
    twin: a TwinnedTBE (same lookups and update, fbgemm's generic row-wise Adagrad loop); None: where that loop is
    the faster on this CPU (CPU ranks, fp32 row-wise Adagrad, generic_update_faster for every dim)."""
    if twin is None:
        twin = (device.type == "cpu" and train.sparse_optimizer is SparseOptimizer.exact_rowwise_adagrad
                and key.dtype is WeightsDtype.fp32 and bool(shard_shapes)
                and all(generic_update_faster(cols) for cols in {c for _, c in shard_shapes}))
    return _tbe(shard_shapes, key, train, device, cache_ratio, twin)


class TwinnedTBE(SplitTableBatchedEmbeddingBagsCodegen):
    """fbgemm's TBE with every table given a second feature that never has an id (feature_table_map t, t for each
    table): fbgemm's CPU backward then updates the rows with its generic loop instead of its row-wise Adagrad JIT
    kernel. forward() takes and returns what the plain TBE does: the twins' empty bags are added to the offsets and
    their (zero) columns dropped from the pooled output."""

    def __init__(self, specs, **kw) -> None:
        super().__init__(specs, feature_table_map=[t for t in range(len(specs)) for _ in range(2)], **kw)
        self.n_tables = len(specs)
        cols, at = [], 0
        for spec in specs:
            cols.append(torch.arange(at, at + spec[1]))
            at += 2 * spec[1]
        self.register_buffer("keep_cols", torch.cat(cols).to(kw["device"]), persistent=False)
        self.twin_cols = _TwinColumns(self.n_tables, {spec[1] for spec in specs})

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights=None, **kw) -> torch.Tensor:
        out = super().forward(indices, twin_offsets(offsets, self.n_tables), per_sample_weights, **kw)
        return _DropTwins.apply(out, self.keep_cols, self.twin_cols)


def twin_offsets(offsets: torch.Tensor, n_tables: int) -> torch.Tensor:
    """fbgemm offsets of n_tables features (table-major, B bags each) with an empty feature after each: its B bags
    all start where the feature's last bag ends."""
    bags = (offsets.numel() - 1) // n_tables
    starts = offsets[:-1].view(n_tables, 1, bags)
    ends = offsets[1:].view(n_tables, bags)[:, -1:].view(n_tables, 1, 1).expand(n_tables, 1, bags)
    return torch.cat([torch.cat([starts, ends], dim=1).reshape(-1), offsets[-1:]])


class _TwinColumns:
    """How a TwinnedTBE's pooled output drops its twins' columns, and the gradient buffer its backward reuses: fresh,
    the [B, 2 x width] gradient with zeroed twin columns was a page-faulted allocation and a zero fill every step
    (~39 ms per call at 512 bags x 856 row-wise pieces of dim 16, 14% of a row-wise bench_856 run's CPU with the
    column drop, measured by py-spy)."""

    def __init__(self, n_tables: int, dims: set[int]):
        self.n_tables = n_tables
        self.dim = next(iter(dims)) if len(dims) == 1 else None   # every table's dim, where they are equal
        self.buffer: Optional[torch.Tensor] = None

    def drop(self, pooled: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return pooled.index_select(1, keep)
        # (equal dims: [B, T, 2, D] -> the real halves, a strided copy ~2.5x faster than index_select on dim 1)
        return pooled.view(pooled.shape[0], self.n_tables, 2, self.dim)[:, :, 0].reshape(pooled.shape[0], -1)

    def grad(self, grad: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
        """The pooled output's gradient: `grad` in the real columns, zeros in the twins' (written once per buffer;
        every step writes only the real columns, and fbgemm only reads the buffer)."""
        shape = (grad.shape[0], width)
        buf = self.buffer
        if buf is None or buf.shape != shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = self.buffer = grad.new_zeros(shape)
        if self.dim is None:
            return buf.index_copy_(1, keep, grad)
        buf.view(shape[0], self.n_tables, 2, self.dim)[:, :, 0].copy_(grad.reshape(shape[0], self.n_tables, self.dim))
        return buf


class _DropTwins(torch.autograd.Function):
    """The pooled columns of the real features; backward: their gradient, zeros in the twins' columns (never read:
    the twins have no ids)."""

    @staticmethod
    def forward(ctx, pooled: torch.Tensor, keep: torch.Tensor, cols: _TwinColumns) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.width, ctx.cols = pooled.shape[1], cols
        return cols.drop(pooled, keep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        keep, = ctx.saved_tensors
        return ctx.cols.grad(grad, keep, ctx.width), None, None


def after_lookup_backward(pooled: torch.Tensor, note) -> None:
    """Call note() once the fbgemm lookup that produced `pooled` (make_tbe's module's output) has run its backward,
    its fused update included: a post-hook on the lookup's autograd node (under TwinnedTBE's column drop)."""
    node = pooled.grad_fn
    if isinstance(node, _DropTwins._backward_cls):
        node = node.next_functions[0][0]
    if node is not None:
        node.register_hook(lambda *_: note())


@functools.lru_cache(maxsize=None)
def generic_update_faster(dim: int) -> bool:
    """Whether fbgemm's generic row-wise Adagrad loop (TwinnedTBE) beats its JIT kernel on this CPU, for tables of
    `dim` columns: the fastest of TWIN_PROBE_REPEATS backwards of each over TWIN_PROBE_ROWS distinct rows."""
    train = TrainConfig(sparse_optimizer=SparseOptimizer.exact_rowwise_adagrad)
    ids = torch.randperm(TWIN_PROBE_ROWS, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    bags = TWIN_PROBE_ROWS // 64
    offsets = torch.arange(0, TWIN_PROBE_ROWS + 1, 64, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # (as a CPU rank runs; several threads on a busy machine time its barriers)
    try:
        best = _probe_backwards(dim, train, ids, offsets, bags)
    finally:
        torch.set_num_threads(threads)
    return best[True] < best[False]


def _probe_backwards(dim: int, train: TrainConfig, ids: torch.Tensor, offsets: torch.Tensor,
                     bags: int) -> dict[bool, float]:
    """generic_update_faster's measurement: the fastest backward of each kind (twinned or not), seconds."""
    best, key = {}, GroupKey(WeightsDtype.fp32.value, MemoryTier.hbm.value)
    for twin in (False, True):
        tbe = _tbe([(TWIN_PROBE_ROWS, dim)], key, train, torch.device("cpu"), 0.0, twin)
        grad = torch.ones(bags, dim)
        laps = []
        for _ in range(TWIN_PROBE_REPEATS):
            out = tbe(ids, offsets)
            t0 = time.perf_counter()
            out.backward(grad)
            laps.append(time.perf_counter() - t0)
        best[twin] = min(laps)
    return best


class ShardedEmbeddings(nn.Module):
    """forward(batch) -> pooled embeddings [B, sum of table dims] for this rank's own samples, tables in model order."""

    def __init__(self, layout: Layout, comm: Comm, train: TrainConfig, batch_size: int, fwd_dtype: CommDtype,
                 bwd_dtype: CommDtype, device: torch.device, stopwatch: Stopwatch, seed: int, dp_group=None,
                 id_group=None, ahead_group=None, *, encoding: RwEncoding, id_dtype: torch.dtype,
                 sums_by_all_to_all: bool = False) -> None:
        """id_group: the step's id exchange (default comm.group); ahead_group: prepare()'s, in the data source's
        thread (None: no prepare); sums_by_all_to_all: the plan's StepStrategies.sums_by_all_to_all."""
        super().__init__()
        self.layout, self.comm, self.device, self.stopwatch = layout, comm, device, stopwatch
        self.batch_size = batch_size
        self.groups: list[tuple[GroupKey, list[LocalShard]]] = layout.me.groups
        self.tbes = nn.ModuleList()
        for key, shards in self.groups:
            ratio = max((s.cache_ratio for s in shards), default=0.0)
            tbe = make_tbe([(s.num_rows, s.num_cols) for s in shards], key, train, device, ratio)
            for s, w in zip(shards, tbe.split_embedding_weights()):
                w[:s.num_rows].copy_(init_rows(seed, s.table, layout.rows[s.table], layout.dims[s.table],
                                               s.row_offset, s.num_rows, s.col_offset, s.num_cols).to(w.dtype))
            self.tbes.append(tbe)
        self.router = IdRouter(layout, batch_size, device, encoding, id_dtype)
        self.id_group = comm.group if id_group is None else id_group
        self.ahead_group = ahead_group
        self.source_cols = [layout.source_columns(k).to(device) for k in EXCHANGED]
        # every column, in order, feeds one kind (e.g. table-wise only): that part is the output itself, no copy
        width = sum(s.num_cols for s in layout.me.features)
        self.whole_part = [len(c) == width and bool((c.cpu() == torch.arange(width)).all()) for c in self.source_cols]
        self.xp = ExchangePlan.build(layout, comm, batch_size, fwd_dtype, bwd_dtype, stopwatch,
                                     sums_by_all_to_all).to(device)
        self.dp_target = layout.target_columns(OutputKind.replicated).to(device)
        self.replicated = ReplicatedEmbeddings(layout.tables_of(OutputKind.replicated), layout.rows, layout.dims,
                                               train.sparse_optimizer, train.sparse_learning_rate, seed, device,
                                               dp_group, comm.world, stopwatch)

    def prepare(self, batch: Batch) -> Batch:
        """The batch with its ids already exchanged (IdRouter.exchange on the ahead group: route, counts and payload
        all-to-alls, receive), for the data source's prefetch thread to run ahead of the step
        (Prefetcher.prepare_with; every rank's thread prepares the same sequence of batches, so their collectives
        pair up on a group of their own); forward() then looks the ids up at once. A batch of the wrong size is
        left for the step to refuse."""
        if self.ahead_group is None:
            raise RuntimeError("ShardedEmbeddings.prepare needs the ahead_group given at construction")
        if batch.batch_size != self.batch_size:
            return batch
        return dataclasses.replace(batch, prepared=Exchanged(self.router, self.router.exchange(self.ahead_group,
                                                                                                batch)))

    def exchanged_ahead(self, batch: Batch) -> Optional[LocalLookups]:
        """The batch's lookups if prepare() exchanged its ids (with this router), else None."""
        done = batch.prepared
        return done.lookups if isinstance(done, Exchanged) and done.router is self.router else None

    def route_ids(self, batch: Batch) -> Routed:
        """A batch's ids, arranged for their owners (not sent yet)."""
        if batch.batch_size != self.batch_size:  # every rank's exchange is sized for train.batch_size samples
            raise DataError(f"rank {self.comm.rank} got a batch of {batch.batch_size} samples; the exchange expects "
                            f"train.batch_size={self.batch_size} on every rank and step")
        return self.router.route(batch)

    def send_ids(self, routed: Routed, recv_counts: Optional[torch.Tensor] = None,
                 then: Optional[Routed] = None) -> PendingIds:
        """Send routed ids to their owners without waiting for them (on the id process group); IdRouter.send."""
        return self.router.send(self.id_group, routed, recv_counts, then)

    def start_ids(self, batch: Batch) -> PendingIds:
        """Send a batch's ids to their owners without waiting for them (on the id process group)."""
        return self.send_ids(self.route_ids(batch))

    def finish_ids(self, pending: PendingIds) -> LocalLookups:
        """Wait for sent ids; what this rank's TBEs look up."""
        return self.router.finish(pending)

    @property
    def has_all_to_all(self) -> bool:
        """Some pooled outputs come back by all-to-all (dense gradients can ride in its backward)."""
        return self.xp.out_to_a2a is not None

    def forward(self, batch: Batch, lookups: Optional[LocalLookups] = None, rider=None,
                pending: bool = False) -> Union[torch.Tensor, PendingPooled]:
        """Pooled embeddings of the batch; `lookups`: its ids already received (the pipelined step), else those
        prepare() received, else they are exchanged here; `rider`: dense gradients to average in the backward
        all-to-all (EmbeddingExchange); `pending` (the plan's StepStrategies.output_overlap: needs an all-to-all
        output and no rider): return them as a PendingPooled whose all-to-all is in flight, for the caller to wait()
        when it needs them."""
        sw, w, b = self.stopwatch, self.comm.world, self.batch_size
        if lookups is None:
            lookups = self.exchanged_ahead(batch)
        if lookups is None:
            with sw("comm_input"):
                lookups = self.finish_ids(self.start_ids(batch))
        with sw("emb_fwd"):
            weights = lookups.weights or [None] * len(self.tbes)   # per-id weights: fbgemm's per_sample_weights
            outs = [tbe(idx, off, per_sample_weights=w) for tbe, (idx, off), w in zip(self.tbes, lookups.per_group,
                                                                                       weights)]
            for out in outs:   # the emb_bwd lap ends when the last TBE's backward has run (Stopwatch)
                after_lookup_backward(out, sw.note_lookup_done)
            if outs:
                pooled = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            else:  # no shard here: still take part in every collective, backward included
                pooled = torch.zeros(w * b, 0, device=self.device, requires_grad=torch.is_grad_enabled())
            if pooled.requires_grad:
                pooled = BackwardMark.apply(sw.note_grad_arrival, pooled)
            parts = [pooled.view(w, b, -1) if whole else pooled.index_select(1, cols).view(w, b, -1)
                     for cols, whole in zip(self.source_cols, self.whole_part)]
        add_local = None
        if self.dp_target.numel():   # the data-parallel replicas' output, added to the exchanged one
            with sw("emb_fwd"):
                local = self.replicated(batch)

            def add_local(out: torch.Tensor) -> torch.Tensor:
                return out.index_add(1, self.dp_target, local)
        if pending:
            if rider is not None or not self.has_all_to_all:
                raise ValueError("ShardedEmbeddings.forward(pending=True) needs an all-to-all output and no rider")
            box = PendingPooled(self.xp, None, parts[1], parts[2], then=add_local)
            box.recv = ExchangeStart.apply(self.xp, box, parts[0])
            return box
        out = EmbeddingExchange.apply(self.xp, rider, *parts)
        return add_local(out) if add_local is not None else out

    # ------------------------------------------------------------ state (checkpoints, tests)

    def shard_state(self) -> list[dict[str, object]]:
        """Per local shard: its place in the table, its weights and its fused-optimizer state (copies); the
        data-parallel replicas last."""
        out = []
        for (key, shards), tbe in zip(self.groups, self.tbes):
            if self._cached(key):
                tbe.flush()  # write the HBM cache's dirty rows back to UVM first
            weights = tbe.split_embedding_weights()
            states = tbe.split_optimizer_states()
            for i, s in enumerate(shards):
                out.append({"table": s.table, "row_offset": s.row_offset, "col_offset": s.col_offset,
                            "weights": weights[i][:s.num_rows].detach().clone().cpu(),
                            "optimizer": [x[:s.num_rows].detach().clone().cpu() for x in states[i]] if states else []})
        return out + self.replicated.shard_state()

    def load_shard_state(self, state: list[dict[str, object]]) -> None:
        flat = [(tbe, i, s) for (key, shards), tbe in zip(self.groups, self.tbes) for i, s in enumerate(shards)]
        n_dp = len(self.replicated.tables)
        if len(flat) + n_dp != len(state):
            raise ValueError(f"checkpoint holds {len(state)} shards for this rank, the layout {len(flat) + n_dp} "
                             f"(checkpoints written before data-parallel tables became local replicas do not load)")
        self.replicated.load_shard_state(state[len(flat):])
        state = state[:len(flat)]
        per_tbe_w = {id(t): t.split_embedding_weights() for t in self.tbes}
        per_tbe_o = {id(t): t.split_optimizer_states() for t in self.tbes}
        for (tbe, i, s), saved in zip(flat, state):
            if (saved["table"], saved["row_offset"], saved["col_offset"]) != (s.table, s.row_offset, s.col_offset):
                raise ValueError("checkpoint shard order differs from the layout")
            per_tbe_w[id(tbe)][i][:s.num_rows].copy_(saved["weights"])
            for dst, src in zip(per_tbe_o[id(tbe)][i] if per_tbe_o[id(tbe)] else [], saved["optimizer"]):
                dst[:s.num_rows].copy_(src)
        for (key, _), tbe in zip(self.groups, self.tbes):
            if self._cached(key):
                tbe.reset_cache_states()  # the cache held rows of the weights just replaced

    def _cached(self, key: GroupKey) -> bool:
        return self.device.type == "cuda" and TIERS[key.tier].hbm_cache
