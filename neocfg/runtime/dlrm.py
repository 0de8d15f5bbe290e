"""The dense part of the DLRM: bottom MLP, feature interaction (dot or DCN-v2 low-rank cross), top MLP."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from neocfg.config.model import ModelConfig
from neocfg.types import DensePrecision, Interaction


# oneDNN's fp32 matmul with the bias and an activation fused (torch's CPU build ships it; torch.compile's CPU code
# calls it). Measured on this project's 2-core AMD EPYC (Zen 5, AVX-512), one thread, criteo's MLP shapes at batch
# 512: ~200 GFLOP/s, where torch's default CPU GEMM (MKL sgemm, what nn.Linear and torch.mm call) runs ~90 GFLOP/s
# (MKL takes its AVX2 path on AMD CPUs); see README "Against TorchRec". On the 2-core Intel Xeon (AVX-512) box the
# two are equal: criteo_tb's top-MLP GEMMs at batch 512, one thread, 156-159 GFLOP/s in oneDNN and 162-168 in MKL
# (no dense lead over TorchRec's nn.Linear there at fp32). Absent on builds without oneDNN.
_ONEDNN_LINEAR = (torch.ops.mkldnn._linear_pointwise
                  if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)
# ... but each oneDNN call costs ~30-40 us more than MKL's, so small layers stay with torch: forward + backward at
# batch 512, one thread, on the same box (ms, oneDNN / torch): 64x64 0.29 / 0.25, 13x512 1.68 / 1.00 (K=13),
# 256x1 0.23 / 0.11; 128x128 0.57 / 0.74, 256x64 0.52 / 0.80, 512x256 ~2.1 / ~4.4. A layer runs in oneDNN when it
# has at least this many inputs and outputs.
ONEDNN_MIN_IN, ONEDNN_MIN_OUT = 128, 64


def _fast_path(x: torch.Tensor) -> bool:
    """The hand-written fp32 CPU kernels below apply: a CPU fp32 tensor outside autocast (bf16 autocast and GPUs
    keep torch's own ops, which autocast knows)."""
    return x.device.type == "cpu" and x.dtype is torch.float32 and not torch.is_autocast_enabled("cpu")


class _LinearOneDnn(torch.autograd.Function):
    """y = act(x W^T + b) in oneDNN, act = ReLU or none; backward: dx = g W, dW = g^T x (oneDNN, strided operands
    read in place), db = sum of g over the batch, g masked by y > 0 first under ReLU (ReLU's own backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
        x = x.contiguous()
        y = _ONEDNN_LINEAR(x, weight, bias, "relu" if relu else "none", [], "")
        ctx.relu, ctx.has_bias = relu, bias is not None
        ctx.save_for_backward(x, weight, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, y = ctx.saved_tensors
        g = g.contiguous()
        if ctx.relu:
            g = torch.ops.aten.threshold_backward(g, y, 0)
        gx = _ONEDNN_LINEAR(g, weight.t(), None, "none", [], "") if ctx.needs_input_grad[0] else None
        gw = _ONEDNN_LINEAR(g.t(), x.t(), None, "none", [], "") if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


class MLP(nn.Sequential):
    """Linear layers with a ReLU after each (after the last one too when last_activation); parameters and
    state_dict keys are nn.Sequential's. On a CPU in fp32, each large Linear (ONEDNN_MIN_IN/OUT) and its ReLU run as
    one oneDNN matmul with the bias and the ReLU fused, forward and backward (_LinearOneDnn): the same fp32 math as
    nn.Linear + nn.ReLU, a faster GEMM. onednn=False (or another device, dtype or autocast) runs torch's modules."""

    def __init__(self, sizes: list[int], last_activation: bool, onednn: bool = True) -> None:
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2 or last_activation:
                layers.append(nn.ReLU())
        super().__init__(*layers)
        # (linear, followed by a ReLU, runs in oneDNN)
        self.fused = [(m, i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU),
                       m.in_features >= ONEDNN_MIN_IN and m.out_features >= ONEDNN_MIN_OUT)
                      for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
        self.onednn = onednn and _ONEDNN_LINEAR is not None and any(big for _, _, big in self.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.onednn and _fast_path(x)):
            return super().forward(x)
        for linear, relu, big in self.fused:
            if big:
                x = _LinearOneDnn.apply(x, linear.weight, linear.bias, relu)
            else:
                x = linear(x)
                x = torch.relu(x) if relu else x
        return x


def mlp(sizes: list[int], last_activation: bool, onednn: bool = True) -> MLP:
    return MLP(sizes, last_activation, onednn)


class _PairDots(torch.autograd.Function):
    """x [B, N, D] -> the dot products of the feature pairs `pairs` (flat indices into the N x N products) [B, P].
    Backward in one bmm: with G the N x N gradient (zero off the pairs), dx = (G + G^T) x, where autograd's bmm
    backward takes two bmms, a transpose and an add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, pairs)
        b, n, _ = x.shape
        return torch.bmm(x, x.transpose(1, 2)).view(b, n * n).index_select(1, pairs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, pairs = ctx.saved_tensors
        b, n, _ = x.shape
        # G + G^T written at once: each pair's gradient at (i, j) and at (j, i) (the pairs are strictly below the
        # diagonal, so no place gets two); no transposed add
        mirrored = (pairs % n) * n + pairs // n
        full = g.new_zeros(b, n * n)
        full.index_copy_(1, pairs, g).index_copy_(1, mirrored, g)
        return torch.bmm(full.view(b, n, n), x), None


class DotInteraction(nn.Module):
    """Pairwise dot products of the bottom output and the pooled embeddings (strict lower triangle), plus the
    bottom output itself (DLRM, Naumov et al. 2019)."""

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        n = num_features + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("pairs", rows * n + cols, persistent=False)
        self.out_dim = dim + len(rows)

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        b, d = bottom.shape
        x = torch.cat([bottom.unsqueeze(1), pooled.view(b, -1, d)], dim=1)     # [B, T+1, D]
        if _fast_path(x):
            return torch.cat([bottom, _PairDots.apply(x, self.pairs)], dim=1)
        z = torch.bmm(x, x.transpose(1, 2))
        return torch.cat([bottom, z[:, self.rows, self.cols]], dim=1)


class _CrossLayer(torch.autograd.Function):
    """One low-rank cross layer y = x0 * (U V x + b) + x with its [B, D]-wide passes fused: forward one addcmul
    after the two thin matmuls; backward dz = g x0, then dx = g + (dz U) V in one addmm and, in the first layer
    (x is x0), + g z in one addcmul into it. Autograd's graph of the same ops makes two more passes forward and
    backward (the separate add, g x0 and g z as new tensors, and two accumulations into x0), each a full pass over
    B x D floats: the cost of the layer on a CPU, where such a pass is memory-bound (856 tables of dim 16: D =
    13,712)."""

    @staticmethod
    def forward(ctx, x0: torch.Tensor, x: torch.Tensor, v: torch.Tensor, u: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        t = x.mm(v.t())                                  # [B, rank]
        z = torch.addmm(b, t, u.t())                     # [B, D]
        ctx.first = x is x0
        ctx.save_for_backward(x0, x, t, z, v, u)
        return torch.addcmul(x, x0, z)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x0, x, t, z, v, u = ctx.saved_tensors
        g = g.contiguous()
        dz = g * x0
        dt = dz.mm(u)                                    # [B, rank]
        dx = torch.addmm(g, dt, v)
        if ctx.first:   # x0 and x are one tensor: its whole gradient here (None for x0's slot)
            dx0 = None
            dx.addcmul_(g, z)
        else:
            dx0 = g * z
        return dx0, dx, dt.t().mm(x), dz.t().mm(t), dz.sum(0)


class LowRankCross(nn.Module):
    """DCN-v2 cross layers, low-rank: x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l (Wang et al. 2021). A CPU fp32 pass
    outside autocast runs each layer as _CrossLayer (the same math, fewer passes over memory)."""

    def __init__(self, dim: int, num_layers: int, rank: int) -> None:
        super().__init__()
        self.v = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(num_layers))
        self.u = nn.ModuleList(nn.Linear(rank, dim) for _ in range(num_layers))
        self.out_dim = dim

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([bottom, pooled], dim=1)
        x = x0
        fused = _fast_path(x0)
        for v, u in zip(self.v, self.u):
            x = _CrossLayer.apply(x0, x, v.weight, u.weight, u.bias) if fused else x0 * u(v(x)) + x
        return x


class DenseArch(nn.Module):
    """(dense features [B, F], pooled embeddings [B, sum dims]) -> logits [B]."""

    def __init__(self, model: ModelConfig, onednn: bool = True) -> None:
        super().__init__()
        bottom = [model.num_dense_features, *model.bottom_layers]
        self.bottom = mlp(bottom, last_activation=True, onednn=onednn)
        if model.interaction is Interaction.dot:
            self.interaction: nn.Module = DotInteraction(len(model.tables), bottom[-1])
        else:
            self.interaction = LowRankCross(bottom[-1] + sum(model.embedding_dims), model.dcn_num_layers,
                                            model.dcn_low_rank_dim)
        self.top = mlp([self.interaction.out_dim, *model.top_mlp], last_activation=False, onednn=onednn)

    def forward(self, dense: torch.Tensor, pooled) -> torch.Tensor:
        """pooled: a tensor, or something to wait() for (neocfg.runtime.dist.PendingPooled: the embeddings'
        all-to-all in flight), waited for after the bottom MLP, which does not need it."""
        bottom = self.bottom(dense)
        if not isinstance(pooled, torch.Tensor):
            pooled = pooled.wait()
        return self.top(self.interaction(bottom, pooled)).squeeze(1)


def build_dense(model: ModelConfig, seed: int, device: torch.device, onednn: bool = True) -> DenseArch:
    """The same initial dense weights on every rank and in any reference run (seeded by train.seed); onednn: the
    MLPs' fused oneDNN kernels where they apply (MLP)."""
    gen_state = torch.get_rng_state()
    torch.manual_seed(seed)
    arch = DenseArch(model, onednn).to(device)
    torch.set_rng_state(gen_state)
    return arch


# DDP as TorchRec's DistributedModelParallel sets it up for the dense part: buffers (the interaction's index
# tables) are constant, so no broadcast before every forward; gradients live in the all-reduce buckets (no copy in
# and out); the graph is the same every step (static_graph: DDP skips searching for unused parameters).
DDP_OPTIONS = {"forward_sync_buffers": False, "gradient_as_bucket_view": True, "static_graph": True}


class DenseGrads:
    """The dense parameters' gradients in one flat fp32 buffer, each parameter's .grad a view of it (like DDP's
    gradient_as_bucket_view), for averaging over ranks in a collective of the caller's: zero() before backward
    (autograd then accumulates into the views), flat for sending, average(everyone) with every rank's buffer
    [world, n] sets each gradient to their mean, summed in rank order on every rank (so all compute the same
    bits)."""

    def __init__(self, module: nn.Module) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if any(p.dtype is not torch.float32 for p in params):
            raise ValueError("DenseGrads: the dense parameters must be fp32")
        device = params[0].device if params else torch.device("cpu")
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero(self) -> None:
        self.flat.zero_()

    def average(self, everyone: torch.Tensor) -> None:
        torch.sum(everyone, dim=0, out=self.flat)
        self.flat.div_(everyone.shape[0])


# Fan-in up to which a weight matrix takes train.dense_learning_rate as it is; a wider one (adagrad, adam) takes
# lr x LR_FAN_IN / fan_in. Source: muP (Yang et al., "Tensor Programs V", 2021, table 3): with Adam-type optimizers,
# whose first steps move every weight by about lr whatever its gradient's scale (Adagrad's too), a hidden layer's
# learning rate must scale as 1/fan_in for its output's change to stay the same. 64: the widest fan-in of
# dlrm_tiny, on which the default learning rate was chosen; measured on 2 CPU ranks (rows capped at 2,000, default
# dims and MLPs): dcnv2_mlperf (cross-layer fan-in 3,456) reached loss 1.3e8 by step 2 at 0.05 without the rule.
LR_FAN_IN = 64


def dense_lr_groups(params, kind, lr: float) -> list[dict]:
    """The dense parameters in optimizer groups by learning rate: LR_FAN_IN / fan_in scaling of the wide weight
    matrices for the adaptive optimizers (see LR_FAN_IN); biases and SGD take lr."""
    from neocfg.types import DenseOptimizer

    groups: dict[float, list] = {}
    for p in params:
        wide = kind is not DenseOptimizer.sgd and p.dim() == 2 and p.shape[1] > LR_FAN_IN
        groups.setdefault(lr * LR_FAN_IN / p.shape[1] if wide else lr, []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in groups.items()]


# Adagrad's accumulator starts here, not at torch's 0 (the practice of TensorFlow's Adagrad, whose default is 0.1):
# from 0 a weight's first updates are lr x g / |g|, a full step of lr whatever the gradient's size, and the tiny
# steady gradients of a DCN cross layer's biases then move them by lr every step. Measured on 2 CPU ranks, batch 64,
# lr 0.05: the shrunk dcnv2_mlperf's loss spiked to 6-17x its start within 12-16 steps for 2 of 4 seeds at 0, none
# at 1e-3 or 0.1; 0.1 also slowed dlrm_tiny (eval AUC 0.55 after 60 steps, 0.6+ at 1e-3 and 0).
ADAGRAD_INITIAL_ACCUMULATOR = 1e-3


def make_dense_optimizer(params, kind, lr: float) -> torch.optim.Optimizer:
    """The dense optimizer, fused: one kernel over all parameters instead of torch's per-parameter loop on CPU
    (Adagrad's fused form is CPU-only in torch; on CUDA it runs foreach, torch's default there). Wide weight matrices
    learn at a rate scaled by their fan-in (dense_lr_groups)."""
    from neocfg.types import DenseOptimizer

    params = list(params)
    cuda = bool(params) and params[0].is_cuda
    cls = {DenseOptimizer.sgd: torch.optim.SGD, DenseOptimizer.adagrad: torch.optim.Adagrad,
           DenseOptimizer.adam: torch.optim.Adam}[kind]
    groups = dense_lr_groups(params, kind, lr)
    extra = {"initial_accumulator_value": ADAGRAD_INITIAL_ACCUMULATOR} if kind is DenseOptimizer.adagrad else {}
    if cuda and kind is DenseOptimizer.adagrad:
        return cls(groups, lr=lr, foreach=True, **extra)
    return cls(groups, lr=lr, fused=True, **extra)


def set_matmul_precision(precision: DensePrecision, device: torch.device) -> None:
    """TF32 tensor-core math for fp32 matmuls on CUDA under dense_precision=tf32, IEEE fp32 otherwise (torch's
    fp32_precision switches; they do nothing on a CPU)."""
    if device.type == "cuda":
        mode = "tf32" if precision is DensePrecision.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.fp32_precision = mode


def dense_autocast(precision: DensePrecision, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the dense forward runs in: autocast to bfloat16 for dense_precision=bf16."""
    if precision is DensePrecision.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
