"""Block-sparse attention against dense attention with the same boolean mask, one process.

Each mask (causal, windows, documents, documents + window, each sparse layout) is built here as a
dense bool # [s, s] straight from its definition, and SDPA with it is the oracle: forward and the
grads of q, k and v at fp32 rtol 1e-5 (differences are reduction order only). Lengths are not
multiples of the block size; a plain window runs by tiles (``test_band_attention``) and, as
``window_by_blocks``, by blocks. The blocks the attention computes (counted by the kernel loop) are
exactly the dense mask's non-empty blocks, each once. A kernel call shares one entry mask among its
rows where they agree, and needs none where every entry is allowed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.core.attention import block_attention as ba
from megalite.core.attention import block_sparse as bs
from megalite.core.attention.masks import MaskSpec, build_block_plan
from megalite.core.attention.sparse_layouts import build_layout

TOL = dict(rtol=1e-5, atol=1e-6)
S, BLOCK = 45, 8


def _dense_mask(s, *, causal=True, window=None, docs=None, layout=None, layout_block=0):
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    ok = torch.ones(s, s, dtype=torch.bool)
    if causal:
        ok &= k <= q
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= k >= q - left
        if right >= 0:
            ok &= k <= q + right
    if docs is not None:
        ok &= docs[:, None] == docs[None, :]
    if layout is not None:
        lay = layout(-(-s // layout_block))
        ok &= lay[q // layout_block, k // layout_block]
    return ok


def _docs(s, cuts):
    d = torch.zeros(s, dtype=torch.long)
    for c in cuts:
        d[c:] += 1
    return d


CASES = {
    "causal": dict(),
    "bidirectional": dict(causal=False),  # every whole block unmasked; the short last one masked
    "window": dict(window=(11, 0)),
    "window_two_sided": dict(causal=False, window=(7, 12)),
    "window_unbounded_right": dict(causal=False, window=(5, -1)),
    "documents": dict(docs=[(9, 30), (17,)]),
    "documents_window": dict(docs=[(9, 30), (4, 20, 21)], window=(6, 0)),
    "fixed": dict(layout=("fixed", dict(num_local_blocks=2, num_global_blocks=1))),
    "bigbird": dict(layout=("bigbird", dict(num_window_blocks=3, num_random_blocks=1, seed=3))),
    "longformer": dict(layout=("longformer", dict(num_window_blocks=3, global_blocks=(2,)))),
    "fixed_small_layout_blocks": dict(
        layout=("fixed", dict(num_local_blocks=3, num_global_blocks=1)), layout_block=5
    ),
}


def _setup(case):
    """(plans, dense masks) of ``case``; ``"window_by_blocks"``: the window with its tiled path
    (``band_attention``) off, so that the block path computes it as it does under documents."""
    if case == "window_by_blocks":
        plans, masks = _setup("window")
        assert plans[0].band == 11
        plans[0].band = None
        return plans, masks
    c = dict(CASES[case])
    causal, window = c.get("causal", True), c.get("window")
    layout, lb = None, 0
    if "layout" in c:
        name, kw = c["layout"]
        layout, lb = build_layout(name, **kw), c.get("layout_block", BLOCK)
    spec = MaskSpec(causal=causal, window=window, layout=layout, layout_block=lb)
    pos = torch.arange(S)
    docs = [_docs(S, cuts) for cuts in c["docs"]] if "docs" in c else None
    if docs is None:
        plans = [build_block_plan(spec, pos, pos, block_size=BLOCK)]
        masks = [_dense_mask(S, causal=causal, window=window, layout=layout, layout_block=lb)]
    else:
        plans = [build_block_plan(spec, pos, pos, block_size=BLOCK, q_doc=d, k_doc=d) for d in docs]
        masks = [_dense_mask(S, causal=causal, window=window, docs=d) for d in docs]
    return plans, masks


def _no_fallback(*args, **kwargs):
    raise AssertionError("the CPU flash kernel refused the masked block")


def _inputs(b=2, n=3, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, S, d, generator=g) for _ in range(4)]


@pytest.mark.parametrize("calls", ["small", "default"])
@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("case", sorted(CASES) + ["window_by_blocks"])
def test_block_sparse_equals_dense_masked(monkeypatch, case, fallback, calls):
    if fallback:
        monkeypatch.setattr(ba, "_cpu_flash_ok", lambda q, p: False)
    elif ba._cpu_flash_ok(torch.zeros(1), 0.0):  # the kernel with the mask, not the matmul block
        monkeypatch.setattr(ba, "_scores", _no_fallback)
    plans, masks = _setup(case)
    q, k, v, dout = _inputs()
    mask = torch.stack(masks)[:, None] if len(masks) > 1 else masks[0]  # [b, 1, s, s] or [s, s]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask, scale=0.3)
    want.backward(dout)
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    # small: groups cut into calls of one or a few rows; default: whole groups, whose rows share
    # one mask where they agree and bring their own where they differ
    max_entries = 3 * BLOCK * BLOCK if calls == "small" else bs.DEFAULT_MAX_ENTRIES
    got = bs.block_sparse_attention(*got_in, plans, scale=0.3, max_entries=max_entries)
    got.backward(dout)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_in, ref):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


@pytest.mark.parametrize("case", sorted(CASES) + ["window_by_blocks"])
def test_computed_blocks_are_the_non_empty_blocks(case):
    plans, masks = _setup(case)
    q, k, v, _ = _inputs(b=1)
    nb = -(-S // BLOCK)
    for plan, mask in zip(plans, masks):
        padded = torch.zeros(nb * BLOCK, nb * BLOCK, dtype=torch.bool)
        padded[:S, :S] = mask
        non_empty = padded.view(nb, BLOCK, nb, BLOCK).any(3).any(1)
        computed = torch.zeros(nb, nb, dtype=torch.long)
        bs.sparse_forward(
            q, k, v, plan, scale=0.3, max_entries=2 * BLOCK * BLOCK, computed=computed
        )
        assert torch.equal(computed, non_empty.long())
        assert torch.equal(plan.blocks, non_empty)
        assert plan.num_computed < nb * nb or case == "bidirectional"


def test_saved_state_is_linear_in_the_sequence():
    plans, _ = _setup("window")
    q, k, v, _ = [t.requires_grad_() for t in _inputs()]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        bs.block_sparse_attention(q, k, v, plans, scale=0.3)
    assert sum(saved) == 4 * q.numel() + q.numel() // q.shape[-1]  # q, k, v, out; lse


def test_layouts_by_hand():
    fixed = build_layout("fixed", num_local_blocks=2, num_global_blocks=1)(4).int()
    assert fixed.tolist() == [[1, 1, 0, 1], [1, 1, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]]
    lf = build_layout("longformer", num_window_blocks=3, global_blocks=(0,))(4).int()
    assert lf.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]
    bb = build_layout("bigbird", num_window_blocks=1, num_global_blocks=0, num_random_blocks=1)
    lay = bb(6)
    assert torch.equal(lay, bb(6))  # seeded
    assert lay.diagonal().all() and (lay.sum(1)[1:] == 2).all() and not lay.triu(1).any()
    with pytest.raises(ValueError, match="sparse_attention must be one of"):
        build_layout("dense")


def test_calls_share_one_mask_where_rows_agree():
    pos = torch.arange(6 * BLOCK)  # whole blocks: no short last block

    def kinds(spec, **kw):
        plan = build_block_plan(spec, pos, pos, block_size=BLOCK, **kw)
        plan.band = None  # a plain window runs by tiles; here: its block calls
        calls = plan.calls(bs.DEFAULT_MAX_ENTRIES)
        return {
            "none" if c.mask is None and not c.per_row else "rows" if c.per_row else "shared"
            for c in calls
        }

    assert kinds(MaskSpec(causal=False)) == {"none"}
    assert kinds(MaskSpec()) == {"shared"}  # every row: full blocks, then its diagonal
    assert kinds(MaskSpec(window=(2 * BLOCK + 3, 0))) == {"shared"}
    layout = build_layout("bigbird", num_window_blocks=3, num_random_blocks=1)
    assert kinds(MaskSpec(layout=layout, layout_block=BLOCK)) == {"shared"}
    docs = (pos >= 20).long()  # a document boundary inside a block
    assert "rows" in kinds(MaskSpec(), q_doc=docs, k_doc=docs)
