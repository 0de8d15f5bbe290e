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



def test_backward_laps(tmp_path, monkeypatch):
    """The replicas' backward has laps of its own (metrics.json's dp_update and comm_dp, which the step takes out of
    "dense"): the dense gradient (from the output gradient's arrival to the hook) and the update in dp_update, the
    all-reduce in comm_dp. A 30 ms pause in each part must land in its own lap only."""
    import time

    import torch.distributed as dist

    from neocfg.batch import Batch
    from neocfg.runtime.replicated import ReplicatedEmbeddings
    from neocfg.runtime.timing import StepTimes, Stopwatch
    from neocfg.types import SparseOptimizer

    pause_s = 0.03
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sw = Stopwatch(torch.device("cpu"))
        rep = ReplicatedEmbeddings([0, 1], [10, 7], [4, 8], SparseOptimizer.exact_rowwise_adagrad, 0.1, 0,
                                   torch.device("cpu"), None, 1, sw)
        all_reduce = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (time.sleep(pause_s), all_reduce(*a, **k))[1])
        # runs after the TBE's backward, before the gradient is accumulated (and the hook fires): gradient time
        rep.tbe.weights.register_hook(lambda g: time.sleep(pause_s))
        lengths = torch.tensor([[2, 0, 1], [1, 3, 1]])
        batch = Batch(dense=torch.zeros(3, 1), lengths=lengths, values=torch.tensor([1, 9, 4, 0, 6, 6, 2, 5]),
                      labels=torch.zeros(3), sample_ids=torch.arange(3))
        before = rep.tbe.weights.detach().clone()
        sw.times = StepTimes()
        rep(batch).sum().backward()
        ms = pause_s * 1e3
        assert ms <= sw.times.dp_update < 2 * ms and ms <= sw.times.comm_dp < 2 * ms, sw.times
        assert not torch.equal(rep.tbe.weights.detach(), before)   # the update ran
    finally:
        dist.destroy_process_group()
