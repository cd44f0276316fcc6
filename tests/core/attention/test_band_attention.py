"""The plain causal window by tiles (``band_attention``) against dense attention with the same
boolean mask, one process.

Windows of 1 key, of lengths that do not divide the sequence, cut into one tile or into several
(m = 2 and 3 tiles back, ``MIN_TILE`` lowered so that small windows are cut), and wider than the
sequence, through ``block_sparse_attention`` (which takes this path for a plain causal window):
forward and the grads of q, k and v at fp32 rtol 1e-5 (reduction order only), with both kernels
(torch's CPU flash op, the matmul block). The path is taken exactly where its conditions hold (a
causal window over positions 0 .. s-1, nothing else), and the blocks its calls touch are the
mask's non-empty blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.core.attention import band_attention, block_sparse
from megalite.core.attention import block_attention as ba
from megalite.core.attention.masks import MaskSpec, build_block_plan
from megalite.core.attention.sparse_layouts import build_layout

TOL = dict(rtol=1e-5, atol=1e-6)
S, BLOCK = 45, 8
# (window, MIN_TILE) -> tile: one tile (11 is prime), 2 and 3 tiles back, wider than S
WINDOWS = {(1, 4): 1, (11, 4): 11, (12, 6): 6, (12, 4): 4, (15, 5): 5, (60, 256): 60}


def _window_mask(s: int, left: int) -> torch.Tensor:
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return (k <= q) & (k >= q - left)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("window,min_tile", sorted(WINDOWS))
def test_band_equals_dense_windowed(monkeypatch, window, min_tile, fallback):
    monkeypatch.setattr(band_attention, "MIN_TILE", min_tile)
    assert band_attention.band_tile(window) == WINDOWS[window, min_tile]
    if fallback:
        monkeypatch.setattr(ba, "_cpu_flash_ok", lambda q, p: False)
    pos = torch.arange(S)
    plan = build_block_plan(MaskSpec(window=(window, 0)), pos, pos, block_size=BLOCK)
    assert plan.band == window
    g = torch.Generator().manual_seed(window)
    q, k, v, dout = (torch.randn(2, 3, S, 8, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=_window_mask(S, window), scale=0.3)
    want.backward(dout)
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    got = block_sparse.block_sparse_attention(*got_in, [plan], scale=0.3)
    got.backward(dout)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_in, ref):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


@pytest.mark.parametrize("window,min_tile", sorted(WINDOWS))
def test_band_calls_touch_the_non_empty_blocks(monkeypatch, window, min_tile):
    monkeypatch.setattr(band_attention, "MIN_TILE", min_tile)
    nb = -(-S // BLOCK)
    padded = torch.zeros(nb * BLOCK, nb * BLOCK, dtype=torch.bool)
    padded[:S, :S] = _window_mask(S, window)
    non_empty = padded.view(nb, BLOCK, nb, BLOCK).any(3).any(1)
    assert torch.equal(band_attention.band_blocks(window, S, BLOCK), non_empty)
    # blocks of one token: the calls let through exactly the mask's entries
    assert torch.equal(band_attention.band_blocks(window, S, 1), _window_mask(S, window))


def test_band_tile_divides_the_window():
    windows = (1, 255, 512, 768, 1000, 1024, 4099)
    assert [band_attention.band_tile(w) for w in windows] == [1, 255, 256, 256, 500, 256, 4099]


def test_band_only_for_a_plain_causal_window():
    pos = torch.arange(S)
    docs = (pos >= 20).long()

    def band(spec, q_pos=pos, k_pos=pos, **kw):
        return build_block_plan(spec, q_pos, k_pos, block_size=BLOCK, **kw).band

    assert band(MaskSpec(window=(7, 0))) == 7
    assert band(MaskSpec(window=(7, -1))) == 7  # causality bounds the right side
    assert band(MaskSpec()) is None  # causal without a window
    assert band(MaskSpec(window=(-1, 0))) is None  # an unbounded window
    assert band(MaskSpec(causal=False, window=(7, 0))) is None
    assert band(MaskSpec(window=(7, 0)), q_doc=docs, k_doc=docs) is None
    layout = build_layout("fixed", num_local_blocks=2)
    assert band(MaskSpec(window=(7, 0), layout=layout, layout_block=BLOCK)) is None
    assert band(MaskSpec(window=(7, 0)), q_pos=pos + 5, k_pos=pos + 5) is None  # a CP chunk
    assert band(MaskSpec(window=(7, 0)), k_pos=pos[:40]) is None
