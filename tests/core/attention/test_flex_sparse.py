"""The flex-attention path of a block plan on CPU: its ``BlockMask`` lists exactly the plan's
blocks (partial blocks with the entry predicate, full ones without), and eager flex attention on
it equals dense attention with the same boolean mask (forward: flex has no CPU backward; the
compiled kernel's grads are checked on a GPU by ``tests/test_cuda_only.py``). The masks and the
oracle are ``test_block_sparse``'s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.core.attention.flex_sparse import (
    flex_available,
    flex_plan_attention,
    flex_serves,
    plan_block_mask,
)
from megalite.core.attention.masks import MaskSpec, build_block_plan
from megalite.core.attention.sparse_layouts import build_layout
from tests.core.attention.test_block_sparse import CASES, TOL, _dense_mask, _docs, _inputs, _setup

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no flex attention")


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_mask_holds_the_plans_blocks(case):
    plans, _ = _setup(case)
    for plan in plans:
        mask = plan_block_mask(plan)
        partial = mask.to_dense()[0, 0].bool()  # to_dense: partial and full blocks together
        assert torch.equal(partial, plan.blocks)
        full = torch.zeros_like(plan.blocks)
        count, index = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
        for row in range(full.shape[0]):
            full[row, index[row, : count[row]].long()] = True
        assert torch.equal(full, plan.full & plan.blocks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_forward_equals_dense_masked(case):
    plans, masks = _setup(case)
    q, k, v, _ = _inputs()
    mask = torch.stack(masks)[:, None] if len(masks) > 1 else masks[0]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    with torch.no_grad():
        got = flex_plan_attention(q, k, v, plans, scale=0.3)
    empty = ~mask.expand(want.shape[0], 1, *mask.shape[-2:]).any(-1)  # rows with no key: 0
    torch.testing.assert_close(got, want.masked_fill(empty[..., None], 0), **TOL)


def test_flex_serves_cuda_with_whole_tiles_only():
    plans, _ = _setup("window")
    assert not flex_serves(torch.zeros(1), plans)  # CPU: the block path


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("case", ["window", "documents_window", "bigbird", "longformer"])
def test_small_blocks_grouped_for_flex(case, block):
    """A plan of 32- or 64-token blocks runs on flex's 128-token blocks: a group is visited
    exactly when the dense mask reaches it, full exactly when every entry is allowed, and the
    output is the dense masked attention's (sequence 300: not a multiple of either block)."""
    s, flex = 300, 128
    c = dict(CASES[case])
    pos = torch.arange(s)
    docs = _docs(s, (97, 230)) if "docs" in c else None
    layout, lb = None, 0
    if "layout" in c:
        name, kw = c["layout"]
        layout, lb = build_layout(name, **kw), 16
    spec = MaskSpec(window=c.get("window"), layout=layout, layout_block=lb)
    plan = build_block_plan(spec, pos, pos, block_size=block, q_doc=docs, k_doc=docs)
    dense = _dense_mask(s, window=c.get("window"), docs=docs, layout=layout, layout_block=lb)
    n = -(-s // flex)
    padded = torch.zeros(n * flex, n * flex, dtype=torch.bool)
    padded[:s, :s] = dense
    tiles = padded.view(n, flex, n, flex)
    whole = torch.zeros_like(padded)
    whole[:s, :s] = True
    whole = whole.view(n, flex, n, flex).all(3).all(1)
    mask = plan_block_mask(plan, flex)
    assert mask.BLOCK_SIZE == (flex, flex)
    assert torch.equal(mask.to_dense()[0, 0].bool(), tiles.any(3).any(1))
    count, index = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    full = torch.zeros(n, n, dtype=torch.bool)
    for row in range(n):
        full[row, index[row, : count[row]].long()] = True
    assert torch.equal(full, tiles.all(3).all(1) & whole)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.3)
    with torch.no_grad():
        got = flex_plan_attention(q, k, v, [plan], scale=0.3)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_model_takes_flex_where_it_serves(monkeypatch, family):
    """The model's windowed and block-sparse layers through flex (forced on here, as on CUDA)
    give the block path's logits: the plans, GQA's expanded heads and the scale reach flex as
    they reach the block path (forward only: flex has no CPU backward)."""
    from megalite.core.parallel_state import ParallelState
    from megalite.models import attention as attention_module
    from megalite.models.gpt import GPTModel
    from tests.models.helpers import make_batch, make_config

    config = make_config(family, num_layers=2, window_size=(37, 0), seq_length=200)
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState.single()).eval()
    tokens, _, _ = make_batch(config, batch=2)
    with torch.no_grad():
        want = model(tokens, None)
        taken = []

        def serves(q, plans):
            taken.append(len(plans))
            return True

        monkeypatch.setattr(attention_module, "flex_serves", serves)
        got = model(tokens, None)
    assert len(taken) == config.num_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
