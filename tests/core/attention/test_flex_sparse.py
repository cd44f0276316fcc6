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
from tests.core.attention.test_block_sparse import CASES, TOL, _inputs, _setup

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
