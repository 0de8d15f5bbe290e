"""The dense part of the DLRM: bottom MLP, feature interaction (dot or DCN-v2 low-rank cross), top MLP."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from neocfg.config.model import ModelConfig
from neocfg.types import DensePrecision, Interaction


def mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """Pairwise dot products of the bottom output and the pooled embeddings (strict lower triangle), plus the
    bottom output itself (DLRM, Naumov et al. 2019)."""

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        n = num_features + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.out_dim = dim + len(rows)

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        b, d = bottom.shape
        x = torch.cat([bottom.unsqueeze(1), pooled.view(b, -1, d)], dim=1)     # [B, T+1, D]
        z = torch.bmm(x, x.transpose(1, 2))
        return torch.cat([bottom, z[:, self.rows, self.cols]], dim=1)


class LowRankCross(nn.Module):
    """DCN-v2 cross layers, low-rank: x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l (Wang et al. 2021)."""

    def __init__(self, dim: int, num_layers: int, rank: int) -> None:
        super().__init__()
        self.v = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(num_layers))
        self.u = nn.ModuleList(nn.Linear(rank, dim) for _ in range(num_layers))
        self.out_dim = dim

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([bottom, pooled], dim=1)
        x = x0
        for v, u in zip(self.v, self.u):
            x = x0 * u(v(x)) + x
        return x


class DenseArch(nn.Module):
    """(dense features [B, F], pooled embeddings [B, sum dims]) -> logits [B]."""

    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        bottom = [model.num_dense_features, *model.bottom_layers]
        self.bottom = mlp(bottom, last_activation=True)
        if model.interaction is Interaction.dot:
            self.interaction: nn.Module = DotInteraction(len(model.tables), bottom[-1])
        else:
            self.interaction = LowRankCross(bottom[-1] + sum(model.embedding_dims), model.dcn_num_layers,
                                            model.dcn_low_rank_dim)
        self.top = mlp([self.interaction.out_dim, *model.top_mlp], last_activation=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.top(self.interaction(self.bottom(dense), pooled)).squeeze(1)


def build_dense(model: ModelConfig, seed: int, device: torch.device) -> DenseArch:
    """The same initial dense weights on every rank and in any reference run (seeded by train.seed)."""
    gen_state = torch.get_rng_state()
    torch.manual_seed(seed)
    arch = DenseArch(model).to(device)
    torch.set_rng_state(gen_state)
    return arch


# DDP as TorchRec's DistributedModelParallel sets it up for the dense part: buffers (the interaction's index
# tables) are constant, so no broadcast before every forward; gradients live in the all-reduce buckets (no copy in
# and out); the graph is the same every step (static_graph: DDP skips searching for unused parameters).
DDP_OPTIONS = {"forward_sync_buffers": False, "gradient_as_bucket_view": True, "static_graph": True}


def make_dense_optimizer(params, kind, lr: float) -> torch.optim.Optimizer:
    """The dense optimizer, fused: one kernel over all parameters instead of torch's per-parameter loop on CPU
    (Adagrad's fused form is CPU-only in torch; on CUDA it runs foreach, torch's default there)."""
    from neocfg.types import DenseOptimizer

    params = list(params)
    cuda = bool(params) and params[0].is_cuda
    cls = {DenseOptimizer.sgd: torch.optim.SGD, DenseOptimizer.adagrad: torch.optim.Adagrad,
           DenseOptimizer.adam: torch.optim.Adam}[kind]
    if cuda and kind is DenseOptimizer.adagrad:
        return cls(params, lr=lr, foreach=True)
    return cls(params, lr=lr, fused=True)


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
