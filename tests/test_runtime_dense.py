"""The dense part's hand-written CPU kernels (neocfg.runtime.dlrm) against torch's own modules: same outputs and
gradients up to fp32 rounding, and the fast path really taken."""

from __future__ import annotations

import pytest
import torch

from neocfg.runtime import dlrm

pytestmark = pytest.mark.skipif(dlrm._ONEDNN_LINEAR is None, reason="torch built without oneDNN")


def _grads(module: torch.nn.Module, inputs: list[torch.Tensor], weight: torch.Tensor):
    """Output and the gradients of sum(output * weight) w.r.t. the inputs that need one and the parameters."""
    for x in inputs:
        x.grad = None
    module.zero_grad(set_to_none=True)
    out = module(*inputs)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in inputs if x.requires_grad] + [p.grad for p in module.parameters()]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # fp32 rounding of sums of a few hundred products, in another order
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def _graph(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind t."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in seen:
            seen.add(type(fn).__name__)
            todo += [f for f, _ in fn.next_functions]
    return seen


# layers above and below ONEDNN_MIN_IN/OUT: both kinds in one MLP
@pytest.mark.parametrize("sizes,last_activation,input_grad", [([13, 128, 64, 16], True, False),
                                                              ([160, 128, 64, 1], False, True)])
def test_onednn_mlp_matches_nn_linear_and_relu(sizes, last_activation, input_grad):
    torch.manual_seed(0)
    fast = dlrm.mlp(sizes, last_activation, onednn=True)
    ref = dlrm.mlp(sizes, last_activation, onednn=False)
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(96, sizes[0], requires_grad=input_grad)
    weight = torch.randn(96, sizes[-1])
    out, grads = _grads(fast, [x], weight)
    assert "_LinearOneDnnBackward" in _graph(fast(x))   # the oneDNN path ran
    out_ref, grads_ref = _grads(ref, [x], weight)
    assert "_LinearOneDnnBackward" not in _graph(ref(x))
    _close(out, out_ref)
    assert len(grads) == len(grads_ref) == 2 * (len(sizes) - 1) + int(input_grad)
    for g, r in zip(grads, grads_ref):
        _close(g, r)
    # ReLU really cut: some outputs of the second (oneDNN) layer are zero, so a missing mask would show
    assert (fast[3](fast[2](fast[1](fast[0](x)))) == 0).any()


def test_pair_dots_interaction_matches_bmm_and_indexing():
    torch.manual_seed(1)
    inter = dlrm.DotInteraction(num_features=5, dim=8)
    bottom = torch.randn(64, 8, requires_grad=True)
    pooled = torch.randn(64, 5 * 8, requires_grad=True)
    weight = torch.randn(64, inter.out_dim)
    out, grads = _grads(inter, [bottom, pooled], weight)

    def reference(bottom, pooled):   # the DLRM paper's form, autograd's bmm backward
        x = torch.cat([bottom.unsqueeze(1), pooled.view(64, -1, 8)], dim=1)
        z = torch.bmm(x, x.transpose(1, 2))
        return torch.cat([bottom, z[:, inter.rows, inter.cols]], dim=1)

    b2, p2 = bottom.detach().clone().requires_grad_(), pooled.detach().clone().requires_grad_()
    out_ref = reference(b2, p2)
    (out_ref * weight).sum().backward()
    _close(out, out_ref.detach())
    _close(grads[0], b2.grad)
    _close(grads[1], p2.grad)
    assert "_PairDotsBackward" in str(inter(bottom, pooled).grad_fn.next_functions)


def test_dense_arch_bf16_autocast_keeps_torch_ops():
    """Under bf16 autocast the fast fp32 kernels step aside (autocast does not know them)."""
    torch.manual_seed(2)
    m = dlrm.mlp([16, 32, 8], True)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype is torch.bfloat16
    assert m(x).dtype is torch.float32


@pytest.mark.parametrize("layers", [1, 3])
def test_fused_cross_layers_match_autograds_dcn(layers):
    """The fused low-rank cross layers (the first layer's x is x0 itself, later layers get x0 and x apart) give
    the outputs and the gradients (inputs, U, V, biases) of autograd's x0 * (U V x + b) + x."""
    torch.manual_seed(3)
    fast = dlrm.LowRankCross(dim=40, num_layers=layers, rank=4)
    for u in fast.u:   # nonzero biases, so that a wrong bias gradient would show
        torch.nn.init.normal_(u.bias)
    ref = dlrm.LowRankCross(dim=40, num_layers=layers, rank=4)
    ref.load_state_dict(fast.state_dict())

    def paper_form(bottom, pooled):   # the paper's form on ref's parameters, autograd's graph
        x0 = torch.cat([bottom, pooled], dim=1)
        x = x0
        for v, u in zip(ref.v, ref.u):
            x = x0 * u(v(x)) + x
        return x

    ref.forward = paper_form
    bottom = torch.randn(48, 8, requires_grad=True)
    pooled = torch.randn(48, 32, requires_grad=True)
    weight = torch.randn(48, 40)
    out, grads = _grads(fast, [bottom, pooled], weight)
    assert "_CrossLayerBackward" in _graph(fast(bottom, pooled))
    out_ref, grads_ref = _grads(ref, [bottom, pooled], weight)
    assert "_CrossLayerBackward" not in _graph(ref(bottom, pooled))
    _close(out, out_ref)
    assert len(grads) == len(grads_ref) == 2 + 3 * layers
    for g, r in zip(grads, grads_ref):
        _close(g, r)
