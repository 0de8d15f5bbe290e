"""ChunkGather (neocfg.runtime.dist): a flat element map done as a gather of aligned runs equals src[index]."""

from __future__ import annotations

import torch

from neocfg.runtime.dist import ChunkGather, _piece_gather


def _blocks(perm: list[int], run: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * run, (p + 1) * run) for p in perm])


def test_runs_found_and_equal_to_the_elementwise_gather():
    src = torch.randn(8 * 16)
    for index, run in [(_blocks([3, 0, 7, 7, 1], 16), 16),      # whole 16-element runs, repeats allowed
                       (_blocks([5, 2, 4], 8)[4:] , 4),          # runs of 8 cut at 4: runs of 4
                       (torch.tensor([1, 2, 3, 4]), 1),          # contiguous but not aligned
                       (torch.tensor([6, 0, 5]), 1)]:
        g = ChunkGather.build(index, src.numel())
        assert g.run == run
        assert torch.equal(g(src), src[index])


def test_zero_run_stands_for_zeros():
    src = torch.randn(4 * 16)
    index = torch.cat([_blocks([2], 16), torch.full((16,), src.numel()), _blocks([0], 16)])
    g = ChunkGather.build(index, src.numel(), zero_run=True)
    assert g.run == 16
    assert torch.equal(g(src), torch.cat([src[32:48], torch.zeros(16), src[:16]]))


def test_piece_gather_puts_each_sources_columns_in_the_output_rows():
    """Source s sends its [B, w_s] block (all_to_all: source-major); the gather of output element (i, col) is
    element (i, c) of the block of col's source, columns in source order, a width-0 source sending nothing."""
    b, widths = 3, [2, 0, 3, 1]
    recv = torch.cat([torch.tensor([[100 * s + 10 * i + c for c in range(w)] for i in range(b)]).reshape(-1)
                      for s, w in enumerate(widths)])
    out = recv[_piece_gather(b, widths)].view(b, sum(widths))
    cols = [(s, c) for s, w in enumerate(widths) for c in range(w)]
    assert out.tolist() == [[100 * s + 10 * i + c for s, c in cols] for i in range(b)]
