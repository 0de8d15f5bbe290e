"""Neo's data-parallel tables: a full replica on every rank, each replica looking up its own local batch only.

All of a rank's data-parallel tables live in one fbgemm DenseTableBatchedEmbeddingBagsCodegen (one flat fp32
weight tensor, a dense gradient). When backward has accumulated that gradient, one all-reduce (on a process group
of its own) sums it over the replicas, and every replica applies the same update to the same weights with the same
deterministic ops, so the replicas stay bit-identical. The update is the sparse optimizer's exact formula (fbgemm's
exact SGD / Adagrad / row-wise Adagrad, eps 1e-8), applied to the dense gradient: rows no sample touched have a zero
gradient and stay as they are, as under the fused sparse update.

Data-parallel replicas are kept in fp32 whatever the plan's weights_dtype. fbgemm's dense TBE does take fp16
weights on CPU, but then hands back an fp16 weight gradient (accumulated in fp16): tried on 3 Dec, a 3-row table
hit by the whole batch ended 30% of its movement away from the unsharded run (tests/test_runtime_correctness.py
fp16_weights; sharded fp16 tables, whose fused update accumulates in fp32, stay within 20%). So the planner offers
data_parallel in fp32 only (DataParallel.weights_dtypes in neocfg/sharding/data_parallel.py) and sizes the replicas at the 4 bytes they use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

from neocfg.batch import Batch
from neocfg.runtime.init_weights import init_rows
from neocfg.runtime.timing import BackwardMark, Stopwatch
from neocfg.types import SparseOptimizer

# fbgemm's default Adagrad epsilon (SplitTableBatchedEmbeddingBagsCodegen(eps=1.0e-8)), so replicas and sharded
# tables follow the same optimizer.
ADAGRAD_EPS = 1.0e-8

_permute_1d = torch.ops.fbgemm.permute_1D_sparse_data

# fbgemm-gpu-cpu registers dense_embedding_codegen_lookup_function (the lookup of DenseTableBatchedEmbeddingBags-
# Codegen) at the CPU dispatch key only, as a kernel that builds its own autograd graph (a C++ autograd::Function:
# the output's grad_fn is fbgemm's backward). With no kernel at an Autograd key, torch's fallback also hooks every
# output to warn at backward ("... an autograd kernel was not registered to the Autograd key(s) but we are trying to
# backprop through it ..."), although the gradient is fbgemm's own and right: data-parallel tables train exactly as
# unsharded ones (tests/test_runtime_correctness.py, cases dp and mixed*), and tests/test_runtime_replicated.py
# checks the gradient against torch's embedding_bag. The remedy torch's message names for a kernel that handles
# autograd itself: a fallthrough at the Autograd key; registered here for CPU only, and only while fbgemm registers
# none itself.
_DENSE_LOOKUP = "dense_embedding_codegen_lookup_function"


def _autograd_fallthrough() -> "torch.library.Library | None":
    name = f"fbgemm::{_DENSE_LOOKUP}"
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
           for key in ("AutogradCPU", "Autograd", "CompositeImplicitAutograd")):
        return None
    lib = torch.library.Library("fbgemm", "IMPL")
    lib.impl(_DENSE_LOOKUP, torch.library.fallthrough_kernel, "AutogradCPU")
    return lib


_FALLTHROUGH = _autograd_fallthrough()   # kept alive: the registration lasts as long as the Library object


class ReplicatedEmbeddings(nn.Module):
    """forward(batch) -> pooled [B, sum of the data-parallel tables' dims] of this rank's own samples."""

    def __init__(self, tables: list[int], rows: list[int], dims: list[int], optimizer: SparseOptimizer, lr: float,
                 seed: int, device: torch.device, group, world: int, stopwatch: Stopwatch | None = None) -> None:
        """stopwatch: where the backward's laps go (dp_update: dense gradient and update; comm_dp: all-reduce)."""
        super().__init__()
        self.tables, self.optimizer, self.lr, self.group, self.world = tables, optimizer, lr, group, world
        self.sw = stopwatch or Stopwatch(torch.device("cpu"))   # host clock, laps nobody reads
        self.t_backward = None
        self.shapes = [(rows[t], dims[t]) for t in tables]
        self.perm = torch.tensor(tables, dtype=torch.long, device=device)
        self.perm32 = self.perm.to(torch.int32)
        self.width = sum(d for _, d in self.shapes)
        self.tbe = (DenseTableBatchedEmbeddingBagsCodegen(self.shapes, use_cpu=device.type == "cpu").to(device)
                    if tables else None)
        self.state: torch.Tensor | None = None   # the optimizer's accumulators (none for SGD)
        self.grad_scale = 1.0 / world   # the global loss is the mean over the global batch
        if self.tbe is None:
            return
        with torch.no_grad():
            for t, w in zip(tables, self.split(self.tbe.weights)):
                w.copy_(init_rows(seed, t, rows[t], dims[t], 0, rows[t]))
        # row of every weight (row-wise Adagrad sums g^2 over each row) and columns of every row
        self.row_of = torch.repeat_interleave(torch.arange(sum(n for n, _ in self.shapes), device=device),
                                              torch.tensor([d for n, d in self.shapes for _ in range(n)],
                                                           device=device))
        self.row_dim = torch.tensor([d for n, d in self.shapes for _ in range(n)], dtype=torch.float32,
                                    device=device)
        self.state = {SparseOptimizer.exact_sgd: None,
                      SparseOptimizer.exact_adagrad: torch.zeros_like(self.tbe.weights, requires_grad=False),
                      SparseOptimizer.exact_rowwise_adagrad: torch.zeros(len(self.row_dim), device=device)}[optimizer]
        if self.state is not None:
            self.state = self.state.detach()
        self.tbe.weights.register_post_accumulate_grad_hook(self._all_reduce_and_update)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per table [rows, dim] views of a flat weight-shaped tensor."""
        sizes = [n * d for n, d in self.shapes]
        return [x.view(n, d) for x, (n, d) in zip(flat.split(sizes), self.shapes)]

    def forward(self, batch: Batch) -> torch.Tensor:
        b = batch.batch_size
        if self.tbe is None:
            return torch.zeros(b, 0, device=batch.values.device)
        lengths, values = batch.lengths.long(), batch.values.long()
        ids, weights = _permute_1d(self.perm32, lengths.sum(dim=1), values, batch.weights, None)[1:3]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.index_select(0, self.perm).reshape(-1))
        out = self.tbe(ids, offsets, per_sample_weights=weights)
        return BackwardMark.apply(self._note_backward, out) if out.requires_grad else out

    def _note_backward(self) -> None:
        """The replicas' output gradient arrived (BackwardMark): the start of their backward (the dense table
        gradient, then the all-reduce and update in the hook, before the exchange's backward runs)."""
        self.t_backward = self.sw.now()

    @torch.no_grad()
    def _all_reduce_and_update(self, weights: torch.Tensor) -> None:
        sw, t_grad = self.sw, self.sw.now()
        if self.t_backward is not None:
            sw.span("dp_update", self.t_backward, t_grad)
            self.t_backward = None
        g = weights.grad
        g.mul_(self.grad_scale)
        with sw("comm_dp"):
            dist.all_reduce(g, group=self.group)         # one collective for every data-parallel table
        t_update = sw.now()
        if self.optimizer is SparseOptimizer.exact_sgd:
            weights.sub_(self.lr * g)
        elif self.optimizer is SparseOptimizer.exact_adagrad:
            self.state.add_(g * g)
            weights.sub_(self.lr * g / (self.state.sqrt() + ADAGRAD_EPS))
        else:  # row-wise: one accumulator per row, the mean of g^2 over the row
            mean_sq = torch.zeros_like(self.state).index_add_(0, self.row_of, g * g) / self.row_dim
            self.state.add_(mean_sq)
            step = self.lr / (self.state.sqrt() + ADAGRAD_EPS)
            weights.sub_(step.index_select(0, self.row_of) * g)
        weights.grad = None
        sw.span("dp_update", t_update, sw.now())

    # ------------------------------------------------------------ state (checkpoints, tests)

    def shard_state(self) -> list[dict[str, object]]:
        if self.tbe is None:
            return []
        weights = self.split(self.tbe.weights.detach())
        if self.optimizer is SparseOptimizer.exact_adagrad:
            states = [[s] for s in self.split(self.state)]
        elif self.optimizer is SparseOptimizer.exact_rowwise_adagrad:
            states = [[s] for s in self.state.split([n for n, _ in self.shapes])]
        else:
            states = [[] for _ in self.shapes]
        return [{"table": t, "row_offset": 0, "col_offset": 0, "weights": w.clone().cpu(),
                 "optimizer": [x.clone().cpu() for x in st]} for t, w, st in zip(self.tables, weights, states)]

    @torch.no_grad()
    def load_shard_state(self, state: list[dict[str, object]]) -> None:
        if [s["table"] for s in state] != self.tables:
            raise ValueError("checkpoint's data-parallel tables differ from the layout's")
        if self.tbe is None:  # no data-parallel table on this layout: nothing to load
            return
        targets = (self.split(self.state) if self.optimizer is SparseOptimizer.exact_adagrad else
                   self.state.split([n for n, _ in self.shapes]) if self.state is not None else [None] * len(state))
        for w, o, saved in zip(self.split(self.tbe.weights) if self.tbe is not None else [], targets, state):
            w.copy_(saved["weights"])
            if o is not None and saved["optimizer"]:
                o.copy_(saved["optimizer"][0])
