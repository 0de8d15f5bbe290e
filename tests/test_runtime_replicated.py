"""Data-parallel replicas' lookup (neocfg.runtime.replicated): fbgemm's dense TBE gradient equals torch's
embedding_bag's, and its backward no longer warns that no autograd kernel is registered."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from neocfg.runtime import replicated  # noqa: F401  (registers the fallthrough)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen


def test_dense_tbe_gradient_is_embedding_bags_and_backward_does_not_warn():
    torch.manual_seed(0)
    shapes = [(10, 4), (7, 8)]
    tbe = DenseTableBatchedEmbeddingBagsCodegen(shapes, use_cpu=True)
    b = 3
    lengths = torch.tensor([[2, 0, 1], [1, 3, 1]])
    ids = torch.tensor([1, 9, 4, 0, 6, 6, 2, 5])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
    weight = torch.randn(b, sum(d for _, d in shapes))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the autograd-fallback warning (or any other) fails the test
        (tbe(ids, offsets) * weight).sum().backward()
    # the same lookups in torch: per table, embedding_bag over its own ids
    flat = tbe.weights.detach().clone().requires_grad_()
    sizes = [n * d for n, d in shapes]
    outs, start = [], 0
    for t, ((n, d), w) in enumerate(zip(shapes, flat.split(sizes))):
        k = int(lengths[t].sum())
        outs.append(F.embedding_bag(ids[start:start + k], w.view(n, d),
                                    torch.cat([torch.zeros(1, dtype=torch.long), lengths[t].cumsum(0)[:-1]]),
                                    mode="sum"))
        start += k
    (torch.cat(outs, dim=1) * weight).sum().backward()
    torch.testing.assert_close(tbe.weights.grad, flat.grad)
    assert tbe.weights.grad.abs().sum() > 0

