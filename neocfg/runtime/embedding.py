"""This rank's embedding shards: one fused fbgemm TBE per (weights precision, memory tier) group, the sparse
optimizer fused into its backward, fed by the id exchange and returning through EmbeddingExchange."""

from __future__ import annotations

import dataclasses
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
from neocfg.types import CommDtype, SparseOptimizer, WeightsDtype

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
def make_tbe(shard_shapes: list[tuple[int, int]], key: GroupKey, train: TrainConfig, device: torch.device,
             cache_ratio: float = 0.0) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One fused TBE over (rows, cols) shards; empty row ranges get one never-addressed row (fbgemm needs >= 1)."""
    if device.type == "cuda":
        loc, compute = GPU_LOCATION[key.tier], ComputeDevice.CUDA
    else:
        loc, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(max(1, rows), cols, loc, compute) for rows, cols in shard_shapes],
        optimizer=FUSED_OPTIMIZERS[train.sparse_optimizer], learning_rate=train.sparse_learning_rate,
        weights_precision=WEIGHTS_PRECISION[key.dtype], stochastic_rounding=True, pooling_mode=PoolingMode.SUM,
        cache_load_factor=cache_ratio or DEFAULT_CACHE_LOAD_FACTOR, device=device)


class ShardedEmbeddings(nn.Module):
    """forward(batch) -> pooled embeddings [B, sum of table dims] for this rank's own samples, tables in model order."""

    def __init__(self, layout: Layout, comm: Comm, train: TrainConfig, batch_size: int, fwd_dtype: CommDtype,
                 bwd_dtype: CommDtype, device: torch.device, stopwatch: Stopwatch, seed: int, dp_group=None,
                 id_group=None, ahead_group=None, *, encoding: RwEncoding, id_dtype: torch.dtype) -> None:
        """id_group: the step's id exchange (default comm.group); ahead_group: prepare()'s, in the data source's
        thread (None: no prepare)."""
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
        self.xp = ExchangePlan.build(layout, comm, batch_size, fwd_dtype, bwd_dtype, stopwatch).to(device)
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
                if out.grad_fn is not None:
                    out.grad_fn.register_hook(sw.note_lookup_done)
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
