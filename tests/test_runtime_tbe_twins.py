"""TwinnedTBE (fbgemm's generic row-wise Adagrad loop through an empty twin feature per table) looks up and trains
exactly as the plain fused TBE, and make_tbe picks it by the probe."""

from __future__ import annotations

import pytest
import torch

from neocfg.config.train import TrainConfig
from neocfg.runtime import embedding
from neocfg.runtime.embedding import TwinnedTBE, make_tbe, twin_offsets
from neocfg.runtime.layout import GroupKey
from neocfg.types import SparseOptimizer

CPU = torch.device("cpu")
KEY = GroupKey("fp32", "hbm")


def _batches(shapes, bags, steps, seed, weighted):
    """Skewed ids (repeats inside and across bags, some empty bags) for every table, table-major."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (len(shapes), bags), generator=g)
        ids = torch.cat([(torch.rand(int(n), generator=g) ** 3 * rows).long().clamp(max=rows - 1)
                         for (rows, _), n in zip(shapes, lengths.sum(dim=1))])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        out.append((ids, offsets, w, torch.randn(bags, sum(c for _, c in shapes), generator=g)))
    return out


def _train(tbe, batches):
    with torch.no_grad():
        for i, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(i)))
    pooled = []
    for ids, offsets, w, grad in batches:
        out = tbe(ids, offsets, per_sample_weights=w)
        pooled.append(out.detach().clone())
        out.backward(grad)
    return (pooled, [w.detach().clone() for w in tbe.split_embedding_weights()],
            [s[0].clone() for s in tbe.split_optimizer_states()])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shapes", [[(50, 16), (7, 8), (300, 16), (1, 4), (120, 32)],   # mixed dims, a one-row table
                                    [(50, 16), (7, 16), (300, 16), (1, 16)]])          # equal dims (strided drop)
def test_twinned_tbe_trains_as_the_plain_one(weighted, shapes):
    """Several steps, the batch size changing in between (the reused gradient buffer follows it)."""
    train = TrainConfig(sparse_optimizer=SparseOptimizer.exact_rowwise_adagrad, sparse_learning_rate=0.1)
    batches = (_batches(shapes, bags=24, steps=3, seed=3, weighted=weighted)
               + _batches(shapes, bags=10, steps=2, seed=4, weighted=weighted))
    plain = make_tbe(shapes, KEY, train, CPU, twin=False)
    twin = make_tbe(shapes, KEY, train, CPU, twin=True)
    assert isinstance(twin, TwinnedTBE) and not isinstance(plain, TwinnedTBE)
    (p_out, p_w, p_m), (t_out, t_w, t_m) = _train(plain, batches), _train(twin, batches)
    for a, b in zip(p_out, t_out):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(p_w + p_m, t_w + t_m):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert any((m > 0).any() for m in t_m)     # the rows were updated, not left alone by both


def test_twin_offsets_add_an_empty_feature_after_each():
    offsets = torch.tensor([0, 2, 2, 5, 6, 9, 9])       # 3 features x 2 bags
    assert twin_offsets(offsets, 3).tolist() == [0, 2, 2, 2, 2, 5, 6, 6, 6, 9, 9, 9, 9]


def test_make_tbe_twins_where_the_probe_says(monkeypatch):
    train = TrainConfig(sparse_optimizer=SparseOptimizer.exact_rowwise_adagrad)
    assert isinstance(embedding.generic_update_faster.__wrapped__(8), bool)     # the probe itself runs
    for faster in (True, False):
        monkeypatch.setattr(embedding, "generic_update_faster", lambda dim, f=faster: f)
        assert isinstance(make_tbe([(10, 8)], KEY, train, CPU), TwinnedTBE) is faster
        # other optimizers and fp16 weights take fbgemm's generic loop anyway: never twinned
        assert not isinstance(make_tbe([(10, 8)], KEY, TrainConfig(sparse_optimizer=SparseOptimizer.exact_sgd),
                                       CPU), TwinnedTBE)
        assert not isinstance(make_tbe([(10, 8)], GroupKey("fp16", "hbm"), train, CPU), TwinnedTBE)
