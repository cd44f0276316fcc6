"""The 2d (TP 4 = 2 x 2, and TP 16 = 4 x 4) and 2.5d (TP 8 = depth 2 x 2 x 2) grid layers equal
their unsharded torch counterparts: outputs and every grad.

The oracle (``nn.Linear``, ``F.layer_norm``, ``nn.Embedding``, ``F.cross_entropy``) runs in the same
rank process on full tensors from the same seed; its results are sliced with ``chunk`` into this
rank's block (batch block ``depth * q + row`` of dim 1, hidden block ``col`` of the last dim),
never with a collective. The loss is ``sum <y, dy>`` over the whole tensor, so each rank feeds its
block of ``dy`` into the backward. Tolerance: fp32, rtol 1e-5 / atol 1e-6 (sharding reorders the
sums inside a matmul or a reduction, nothing else).

TP 16 needs 16 gloo ranks, whose start costs more than the checks: every layer's check runs in one
case on one grid (``test_grid_layers_at_tp16``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.tensor_parallel.init import init_normal
from megalite.core.tensor_parallel.modes import (
    Grid,
    GridEmbedding,
    GridLayerNorm,
    GridLinear,
    GridRMSNorm,
    grid_cross_entropy,
)
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
# B, H_IN and H_OUT / 2 (SwiGLU's stacked halves) divide by every grid side here, q = 2 and 4
S, B, H_IN, H_OUT, VOCAB = 3, 4, 8, 16, 30
LAYOUTS = {"2d": (4, 1), "2.5d": (8, 2)}  # mode -> (tensor_model_parallel_size, depth)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _act(x: torch.Tensor, g: Grid) -> torch.Tensor:
    """This rank's block of an activation ``[s, b, h]``: ``[s, b/(dq), h/q]``."""
    return x.chunk(g.batch_blocks, 1)[g.batch_block].chunk(g.q, -1)[g.col]


def _weight(w: torch.Tensor, g: Grid, stride: int = 1) -> torch.Tensor:
    """This rank's block of a full ``[out, in]`` weight: out block col (of each of ``stride``
    stacked parts), in block row."""
    out = torch.cat([part.chunk(g.q, 0)[g.col] for part in w.chunk(stride, 0)], 0)
    return out.chunk(g.q, 1)[g.row]


def _grid(mode):
    tp, depth = LAYOUTS[mode]
    return Grid.of(mesh(tp, mode=mode, depth=depth))


def _check_linear(g: Grid, stride: int) -> None:
    key = init_normal(0.5, seed=7, key="w")
    layer = GridLinear(H_IN, H_OUT, grid=g, init_method=key, stride=stride)
    ref = nn.Linear(H_IN, H_OUT)
    with torch.no_grad():
        key(ref.weight)
        ref.bias.copy_(_rand(H_OUT, seed=3))
        layer.bias.copy_(torch.cat([p.chunk(g.q)[g.col] for p in ref.bias.chunk(stride)]))
    x = _rand(S, B, H_IN, seed=0).requires_grad_()
    dy = _rand(S, B, H_OUT, seed=1)
    ref(x).backward(dy)
    x_mine = _act(x.detach(), g).clone().requires_grad_()
    y, _ = layer(x_mine)
    dy_mine = torch.cat([p.chunk(g.q, -1)[g.col] for p in dy.chunk(stride, -1)], -1)
    dy_mine = dy_mine.chunk(g.batch_blocks, 1)[g.batch_block]
    y_ref = torch.cat([p.chunk(g.q, -1)[g.col] for p in ref(x).detach().chunk(stride, -1)], -1)
    torch.testing.assert_close(y, y_ref.chunk(g.batch_blocks, 1)[g.batch_block], **TOL)
    y.backward(dy_mine)
    torch.testing.assert_close(x_mine.grad, _act(x.grad, g), **TOL)
    torch.testing.assert_close(layer.weight.grad, _weight(ref.weight.grad, g, stride), **TOL)
    bias_ref = torch.cat([p.chunk(g.q)[g.col] for p in ref.bias.grad.chunk(stride)])
    torch.testing.assert_close(layer.bias.grad, bias_ref, **TOL)


def _check_norm(g: Grid, kind: str) -> None:
    cls = GridLayerNorm if kind == "layernorm" else GridRMSNorm
    norm = cls(H_IN, grid=g)
    w_full, b_full = _rand(H_IN, seed=4), _rand(H_IN, seed=5)
    with torch.no_grad():
        norm.weight.copy_(w_full.chunk(g.q)[g.col])
        if norm.bias is not None:
            norm.bias.copy_(b_full.chunk(g.q)[g.col])
    w_ref, b_ref = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    x = _rand(S, B, H_IN, seed=0).requires_grad_()
    dy = _rand(S, B, H_IN, seed=1)
    if kind == "layernorm":
        y_ref = F.layer_norm(x, (H_IN,), w_ref, b_ref, 1e-5)
    else:
        y_ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w_ref
    y_ref.backward(dy)
    x_mine = _act(x.detach(), g).clone().requires_grad_()
    y = norm(x_mine)
    torch.testing.assert_close(y, _act(y_ref.detach(), g), **TOL)
    y.backward(_act(dy, g))
    torch.testing.assert_close(x_mine.grad, _act(x.grad, g), **TOL)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad.chunk(g.q)[g.col], **TOL)
    if kind == "layernorm":
        torch.testing.assert_close(norm.bias.grad, b_ref.grad.chunk(g.q)[g.col], **TOL)


def _check_embedding_and_loss(g: Grid) -> None:
    key = init_normal(0.5, seed=7, key="emb")
    emb = GridEmbedding(VOCAB, H_IN, grid=g, make_vocab_size_divisible_by=4, init_method=key)
    padded = emb.padded_num_embeddings  # 32: a multiple of 4 x q
    ref = nn.Embedding(VOCAB, H_IN)
    with torch.no_grad():
        key(ref.weight)
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(2))
    dy = _rand(S, B, H_IN, seed=1)
    y_ref = ref(ids)
    y_ref.backward(dy)
    ids_mine = ids.chunk(g.batch_blocks, 1)[g.batch_block]
    y = emb(ids_mine)
    torch.testing.assert_close(y, _act(y_ref.detach(), g), **TOL)
    y.backward(_act(dy, g))
    grad_full = torch.zeros(padded, H_IN)
    grad_full[:VOCAB] = ref.weight.grad
    torch.testing.assert_close(
        emb.weight.grad, grad_full.chunk(g.q, 0)[g.row].chunk(g.q, 1)[g.col], **TOL
    )

    # the loss over a vocab split across the grid row; padding columns never count
    logits = _rand(S, B, padded, seed=6)
    logits[..., VOCAB:] = 1e3  # padding: ignored, however large
    logits.requires_grad_()
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(8))
    loss_ref = F.cross_entropy(
        logits[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none"
    ).view(S, B)
    loss_ref.sum().backward()
    mine = _act(logits.detach(), g).clone().requires_grad_()
    loss = grid_cross_entropy(
        mine, target.chunk(g.batch_blocks, 1)[g.batch_block], grid=g, vocab_size=VOCAB
    )
    torch.testing.assert_close(loss, loss_ref.detach().chunk(g.batch_blocks, 1)[g.batch_block])
    loss.sum().backward()
    torch.testing.assert_close(mine.grad, _act(logits.grad, g), **TOL)


def _linear_case(mode, stride):
    _check_linear(_grid(mode), stride)


def _norm_case(mode, kind):
    _check_norm(_grid(mode), kind)


def _embedding_and_loss_case(mode):
    _check_embedding_and_loss(_grid(mode))


def _all_layers_case(tp: int) -> list[int]:
    """Every check on one 2d grid of ``tp`` ranks; returns this rank's (row, col)."""
    g = Grid.of(mesh(tp, mode="2d"))
    _check_linear(g, 1)
    _check_linear(g, 2)
    _check_norm(g, "layernorm")
    _check_norm(g, "rmsnorm")
    _check_embedding_and_loss(g)
    return [g.row, g.col]


@pytest.mark.parametrize("mode", sorted(LAYOUTS))
def test_grid_linear_equals_nn_linear(mode):
    tp = LAYOUTS[mode][0]
    run_distributed(_linear_case, tp, mode, 1)
    run_distributed(_linear_case, tp, mode, 2)  # [gate; up] stacked, as SwiGLU's fc1


@pytest.mark.parametrize("mode", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_grid_norms_over_a_split_hidden_dim(mode, kind):
    run_distributed(_norm_case, LAYOUTS[mode][0], mode, kind)


@pytest.mark.parametrize("mode", sorted(LAYOUTS))
def test_grid_embedding_and_cross_entropy(mode):
    run_distributed(_embedding_and_loss_case, LAYOUTS[mode][0], mode)


def test_grid_layers_at_tp16():
    # 2d at q = 4: the linear (plain and stacked), both norms, the embedding and the loss
    coords = run_distributed(_all_layers_case, 16, 16)
    assert coords == [[t // 4, t % 4] for t in range(16)]  # tp_rank = col + q * row
