"""Every tensor-parallel layer equals its torch counterpart on the unsharded weights.

The oracle is built in the same rank process from the same seed (torch ``nn.Linear``,
``nn.Embedding``, ``F.cross_entropy``); it is sliced with ``chunk(tp, dim)[tp_rank]``, never with a
collective. Tolerance: fp32, rtol 1e-5 / atol 1e-6 -- sharding changes only the order of the
reductions inside a matmul or an all-reduce (a few ulps), never the math.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads
from megalite.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)
from megalite.core.tensor_parallel.init import init_normal
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
S, B, H_IN, H_OUT, VOCAB = 8, 2, 12, 16, 50


def _full(shape, key):
    w = torch.empty(shape)
    init_normal(0.5, seed=7, key=key)(w)
    return w


def _inputs(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_column(ps, sp, gather_output):
    tp, r = ps.tp_size, ps.tp_rank
    layer = ColumnParallelLinear(
        H_IN,
        H_OUT,
        tp_group=ps.tp_group,
        sequence_parallel=sp,
        gather_output=gather_output,
        init_method=init_normal(0.5, seed=7, key="col"),
    )
    with torch.no_grad():
        layer.bias.copy_(_full((H_OUT,), "colb").chunk(tp)[r])
    ref = nn.Linear(H_IN, H_OUT)
    with torch.no_grad():
        ref.weight.copy_(_full((H_OUT, H_IN), "col"))
        ref.bias.copy_(_full((H_OUT,), "colb"))
    x = _inputs(S, B, H_IN).requires_grad_()
    dy = _inputs(S, B, H_OUT, seed=1)
    y_ref = ref(x)
    y_ref.backward(dy)

    x_mine = (x.detach().chunk(tp, 0)[r] if sp else x.detach()).clone().requires_grad_()
    y, _ = layer(x_mine)
    if gather_output:
        torch.testing.assert_close(y, y_ref, **TOL)
        y.backward(dy)
    else:
        torch.testing.assert_close(y, y_ref.chunk(tp, -1)[r], **TOL)
        y.backward(dy.chunk(tp, -1)[r])
    dx_ref = x.grad.chunk(tp, 0)[r] if sp else x.grad
    torch.testing.assert_close(x_mine.grad, dx_ref, **TOL)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **TOL)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad.chunk(tp, 0)[r], **TOL)


def _check_row(ps, sp, input_is_parallel):
    tp, r = ps.tp_size, ps.tp_rank
    layer = RowParallelLinear(
        H_OUT,
        H_IN,
        tp_group=ps.tp_group,
        sequence_parallel=sp,
        input_is_parallel=input_is_parallel,
        init_method=init_normal(0.5, seed=7, key="row"),
    )
    with torch.no_grad():
        layer.bias.copy_(_full((H_IN,), "rowb"))
    ref = nn.Linear(H_OUT, H_IN)
    with torch.no_grad():
        ref.weight.copy_(_full((H_IN, H_OUT), "row"))
        ref.bias.copy_(_full((H_IN,), "rowb"))
    x = _inputs(S, B, H_OUT).requires_grad_()
    dy = _inputs(S, B, H_IN, seed=1)
    y_ref = ref(x)
    y_ref.backward(dy)

    x_mine = (x.detach().chunk(tp, -1)[r] if input_is_parallel else x.detach()).clone()
    x_mine.requires_grad_()
    y, _ = layer(x_mine)
    if sp:
        torch.testing.assert_close(y, y_ref.chunk(tp, 0)[r], **TOL)
        y.backward(dy.chunk(tp, 0)[r])
        all_reduce_sequence_parallel_grads(layer.parameters(), ps.tp_group)
    else:
        torch.testing.assert_close(y, y_ref, **TOL)
        y.backward(dy)
    dx_ref = x.grad.chunk(tp, -1)[r] if input_is_parallel else x.grad
    torch.testing.assert_close(x_mine.grad, dx_ref, **TOL)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad.chunk(tp, 1)[r], **TOL)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)


def _check_embedding(ps, sp, divisible_by):
    tp, r = ps.tp_size, ps.tp_rank
    emb = VocabParallelEmbedding(
        VOCAB,
        H_IN,
        tp_group=ps.tp_group,
        make_vocab_size_divisible_by=divisible_by,
        reduce_scatter_embeddings=sp,
        init_method=init_normal(0.5, seed=7, key="emb"),
    )
    v_pad = padded_vocab_size(VOCAB, make_vocab_size_divisible_by=divisible_by, tp_size=tp)
    assert emb.padded_num_embeddings == v_pad and v_pad % tp == 0
    ref = nn.Embedding(VOCAB, H_IN)
    with torch.no_grad():
        ref.weight.copy_(_full((VOCAB, H_IN), "emb"))
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(3))
    ids[0, 0], ids[-1, -1] = 0, VOCAB - 1  # both ends of the vocabulary
    dy = _inputs(S, B, H_IN, seed=1)
    y_ref = ref(ids)
    y_ref.backward(dy)
    y = emb(ids)
    if sp:
        torch.testing.assert_close(y, y_ref.chunk(tp, 0)[r], **TOL)
        y.backward(dy.chunk(tp, 0)[r])
    else:
        torch.testing.assert_close(y, y_ref, **TOL)
        y.backward(dy)
    grad_padded = torch.cat([ref.weight.grad, torch.zeros(v_pad - VOCAB, H_IN)])
    torch.testing.assert_close(emb.weight.grad, grad_padded.chunk(tp, 0)[r], **TOL)
    # padding rows are zero at init: the function does not depend on the padding
    w_padded = torch.cat([ref.weight.detach(), torch.zeros(v_pad - VOCAB, H_IN)])
    torch.testing.assert_close(emb.weight.detach(), w_padded.chunk(tp, 0)[r], **TOL)


def _check_cross_entropy(ps, label_smoothing, with_mask):
    tp, r = ps.tp_size, ps.tp_rank
    v_pad = padded_vocab_size(VOCAB, make_vocab_size_divisible_by=4, tp_size=tp)
    logits = _inputs(S, B, v_pad, seed=5) * 4
    logits[..., VOCAB:] = 1e4  # padding columns hold garbage: they must take no probability mass
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(6))
    mask = (_inputs(S, B, seed=8) > 0).float() if with_mask else None
    dloss = _inputs(S, B, seed=9)

    ref_logits = logits[..., :VOCAB].clone().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.reshape(-1, VOCAB),
        target.reshape(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(S, B)
    if mask is not None:
        ref = ref * mask
    ref.backward(dloss)

    mine_logits = logits.chunk(tp, -1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        mine_logits,
        target,
        tp_group=ps.tp_group,
        vocab_size=VOCAB,
        label_smoothing=label_smoothing,
        loss_mask=mask,
    )
    torch.testing.assert_close(loss, ref, **TOL)
    loss.backward(dloss)
    grad_padded = torch.cat([ref_logits.grad, torch.zeros(S, B, v_pad - VOCAB)], dim=-1)
    torch.testing.assert_close(mine_logits.grad, grad_padded.chunk(tp, -1)[r], **TOL)


def _all_layer_cases(tp):
    ps = mesh(tp, 1)
    torch.manual_seed(0)
    for sp in (False, True):
        for gather in (False, True) if not sp else (False,):
            _check_column(ps, sp, gather)
        for parallel_in in (True, False) if not sp else (True,):
            _check_row(ps, sp, parallel_in)
        for divisible_by in (1, 8):
            _check_embedding(ps, sp, divisible_by)
    for ls in (0.0, 0.1):
        for with_mask in (False, True):
            _check_cross_entropy(ps, ls, with_mask)
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_equal_torch_on_unsharded_weights(tp):
    assert run_distributed(_all_layer_cases, tp, tp) == [True] * tp


def test_padded_vocab_size():
    assert padded_vocab_size(50257, make_vocab_size_divisible_by=128, tp_size=1) == 50304
    assert padded_vocab_size(50257, make_vocab_size_divisible_by=128, tp_size=8) == 51200
    assert padded_vocab_size(128, make_vocab_size_divisible_by=128, tp_size=1) == 128
