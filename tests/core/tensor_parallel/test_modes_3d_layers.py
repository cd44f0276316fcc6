"""Every 3D tensor-parallel layer equals its unsharded torch counterpart, at TP 8 (q = 2).

The oracle is torch (``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Embedding``, a
position table's rows, ``F.cross_entropy``) on the full weights, in the same rank process from the
same seed; it is sliced with ``chunk`` by this file's ``act_block`` / ``weight_block`` (the layout
table of ``layers3d.py`` written out in coordinates), never with a collective. Tolerance: fp32,
rtol 1e-5 / atol 1e-6 -- a 3D layer changes only the order of the sums (a matmul's contraction
cut in q partial products).

Bytes: every collective a layer issues is counted at ``megalite.core.groups`` by the op recorder
and priced with the ring convention of ``cost3d.py``; the sum equals the closed form. A linear's
activation bytes (what its forward saves for backward, seen by saved-tensor hooks, weights left
out) equal ``linear3d_activation_bytes``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.core.op_record import RECORDER
from megalite.core.tensor_parallel import padded_vocab_size
from megalite.core.tensor_parallel.init import init_normal
from megalite.core.tensor_parallel.modes.cost3d import (
    cross_entropy3d_bytes,
    embedding3d_bytes,
    linear3d_activation_bytes,
    linear3d_bytes,
    norm3d_bytes,
    position3d_bytes,
)
from megalite.core.tensor_parallel.modes.grid3d import (
    SUB_AXES_3D,
    Groups3D,
    grid3d_groups,
    other_layout,
)
from megalite.core.tensor_parallel.modes.layers3d import LayerNorm3D, Linear3D, RMSNorm3D
from megalite.core.tensor_parallel.modes.vocab3d import (
    PositionEmbedding3D,
    VocabEmbedding3D,
    cross_entropy_3d,
)
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
Q = 2
S, B, K, N, VOCAB = 4, 4, 8, 16, 14


# --- the groups and the oracle's slicing (shared with the block test) -------------------------
def groups3d(q: int = Q) -> Groups3D:
    """The sub-axis groups of this rank's TP group (TP = world = q^3), made with ``new_group``
    over the rank lists of ``grid3d_groups``, every rank making every group in the same order."""
    ps = mesh(q**3)
    tp_ranks = dist.get_process_group_ranks(ps.tp_group)
    me, mine = dist.get_rank(), {}
    for axis in SUB_AXES_3D:
        for members in grid3d_groups(tp_ranks, q)[axis]:
            group = dist.new_group(members)
            if me in members:
                mine[axis] = group
    return Groups3D.of(mine, q, tp_ranks.index(me))


def _blocks(g: Groups3D, layout: str) -> tuple[int, int]:
    """(batch block of q^2, hidden block of q) of ``layout`` on this rank, from the coordinates."""
    if layout == "residual":
        return g.weight_rank * g.q + g.input_rank, g.output_rank
    return g.weight_rank * g.q + g.output_rank, g.input_rank


def act_block(full: torch.Tensor, g: Groups3D, layout: str, *, stride: int = 1) -> torch.Tensor:
    """This rank's block of a full ``[s, b, h]`` activation (``stride`` stacked hidden blocks)."""
    batch, hidden = _blocks(g, layout)
    rows = full.chunk(g.q * g.q, dim=1)[batch]
    return torch.cat([p.chunk(g.q, dim=-1)[hidden] for p in rows.chunk(stride, dim=-1)], dim=-1)


def weight_block(full: torch.Tensor, g: Groups3D, layout: str, *, stride: int = 1) -> torch.Tensor:
    """This rank's block of a full ``[N, K]`` weight (or ``[N]`` bias) of a linear taking
    ``layout``: rows by (output hidden block, weight rank), columns by the input hidden block."""
    _, k_block = _blocks(g, layout)
    _, n_block = _blocks(g, other_layout(layout))
    pieces = [p.chunk(g.q**2, dim=0)[n_block * g.q + g.weight_rank] for p in full.chunk(stride)]
    rows = torch.cat(pieces)
    return rows if full.dim() == 1 else rows.chunk(g.q, dim=1)[k_block]


def full_tensor(shape, key: str, std: float = 0.5) -> torch.Tensor:
    w = torch.empty(shape)
    init_normal(std, seed=7, key=key)(w)
    return w


def sent_bytes() -> float:
    """What this rank sent in the recorded collectives, by the ring convention (``cost3d.py``)."""
    total = 0.0
    for rec in RECORDER.records():
        n, numel = len(rec.channel) - 2, 4
        for d in rec.shape:
            numel *= d
        if rec.op == "all_gather":  # the recorded shape is this rank's part
            total += (n - 1) * numel
        elif rec.op == "reduce_scatter":  # the recorded shape is the whole input
            total += (n - 1) / n * numel
        elif rec.op == "all_reduce":
            total += 2 * (n - 1) / n * numel
        else:
            raise AssertionError(f"unexpected collective {rec.op}")
    return total


def _packer(saved: list[torch.Tensor]):
    """A saved-tensor pack hook that lists what autograd keeps for backward."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    return pack


def record():
    RECORDER.enable(capacity=4096)


# --- the layers -------------------------------------------------------------------------------
def _check_linear(g, layout, bias, stride):
    out_layout = other_layout(layout)
    layer = Linear3D(
        K,
        N,
        g,
        input_layout=layout,
        bias=bias,
        stride=stride,
        init_method=init_normal(0.5, seed=7, key="lin"),
    )
    ref = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(full_tensor((N, K), "lin"))
        if bias:
            ref.bias.copy_(full_tensor((N,), "linb"))
            layer.bias.copy_(weight_block(ref.bias, g, layout, stride=stride))
    x = full_tensor((S, B, K), "x").requires_grad_()
    dy = full_tensor((S, B, N), "dy")
    ref(x).backward(dy)
    y_ref = ref(x).detach()

    x_mine = act_block(x.detach(), g, layout).requires_grad_()
    record()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(_packer(saved), lambda t: t):
        y = layer(x_mine)
    y.backward(act_block(dy, g, out_layout, stride=stride))
    weights = {p.data_ptr() for p in layer.parameters()}
    kept = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in weights)
    assert kept == linear3d_activation_bytes(S * B, K, g.q)
    sent = sent_bytes()
    RECORDER.disable()
    torch.testing.assert_close(y, act_block(y_ref, g, out_layout, stride=stride), **TOL)
    torch.testing.assert_close(x_mine.grad, act_block(x.grad, g, layout), **TOL)
    torch.testing.assert_close(
        layer.weight.grad, weight_block(ref.weight.grad, g, layout, stride=stride), **TOL
    )
    if bias:
        torch.testing.assert_close(
            layer.bias.grad, weight_block(ref.bias.grad, g, layout, stride=stride), **TOL
        )
    assert sent == linear3d_bytes(S * B, K, N, g.q, bias=bias)


def _check_norm(g, layout, rms):
    cls, ref = (RMSNorm3D, nn.RMSNorm(K, eps=1e-5)) if rms else (LayerNorm3D, nn.LayerNorm(K))
    layer = cls(K, g, layout=layout)
    params = ["weight"] if rms else ["weight", "bias"]
    _, hidden = _blocks(g, layout)
    with torch.no_grad():
        for name in params:  # not the ones / zeros of init, so every grad path shows
            getattr(ref, name).copy_(full_tensor((K,), f"norm.{name}"))
            getattr(layer, name).copy_(getattr(ref, name).chunk(g.q)[hidden])
    x = (full_tensor((S, B, K), "x") + 0.3).requires_grad_()
    dy = full_tensor((S, B, K), "dy")
    y_ref = ref(x)
    y_ref.backward(dy)

    x_mine = act_block(x.detach(), g, layout).requires_grad_()
    record()
    y = layer(x_mine)
    y.backward(act_block(dy, g, layout))
    sent = sent_bytes()
    RECORDER.disable()
    torch.testing.assert_close(y, act_block(y_ref.detach(), g, layout), **TOL)
    torch.testing.assert_close(x_mine.grad, act_block(x.grad, g, layout), **TOL)
    for name in params:
        expected = getattr(ref, name).grad.chunk(g.q)[hidden]
        torch.testing.assert_close(getattr(layer, name).grad, expected, **TOL)
    assert sent == pytest.approx(norm3d_bytes(S * B, K, g.q, rms=rms), rel=1e-12)


def _check_embedding(g):
    v_pad = padded_vocab_size(VOCAB, make_vocab_size_divisible_by=1, tp_size=g.q**2)
    emb = VocabEmbedding3D(
        v_pad, K, g, init_method=init_normal(0.5, seed=7, key="emb"), init_rows=VOCAB
    )
    ref = nn.Embedding(VOCAB, K)
    with torch.no_grad():
        ref.weight.copy_(full_tensor((VOCAB, K), "emb"))
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(3))
    ids[0, 0], ids[-1, -1] = 0, VOCAB - 1  # both ends of the vocabulary
    dy = full_tensor((S, B, K), "dy")
    y_ref = ref(ids)
    y_ref.backward(dy)

    record()
    y = emb(ids)
    y.backward(act_block(dy, g, "residual"))
    sent = sent_bytes()
    RECORDER.disable()
    torch.testing.assert_close(y, act_block(y_ref.detach(), g, "residual"), **TOL)
    # the table: vocab block input_rank of q, hidden block (output_rank, weight_rank) of q^2
    grad = torch.cat([ref.weight.grad, torch.zeros(v_pad - VOCAB, K)])
    expected = grad.chunk(g.q)[g.input_rank].chunk(g.q**2, dim=1)[
        g.output_rank * g.q + g.weight_rank
    ]
    torch.testing.assert_close(emb.weight.grad, expected, **TOL)
    assert sent == embedding3d_bytes(S * B, v_pad, K, g.q)


def _check_position(g):
    max_pos = 2 * S
    pos = PositionEmbedding3D(max_pos, K, g, init_method=init_normal(0.5, seed=7, key="pos"))
    table = full_tensor((max_pos, K), "pos").requires_grad_()
    dy = full_tensor((S, B, K), "dy")
    y_ref = table[:S].unsqueeze(1).expand(S, B, K)  # added to every sequence of the batch
    y_ref.backward(dy)

    record()
    y = pos(S)  # [s, 1, h/q], broadcast over this rank's sequences
    (y.expand(-1, B // g.q**2, -1) * act_block(dy, g, "residual")).sum().backward()
    sent = sent_bytes()
    RECORDER.disable()
    torch.testing.assert_close(y[:, 0], table.detach()[:S].chunk(g.q, dim=1)[g.output_rank], **TOL)
    torch.testing.assert_close(pos.weight.grad, table.grad.chunk(g.q, dim=1)[g.output_rank], **TOL)
    assert sent == pytest.approx(position3d_bytes(S, K, g.q), rel=1e-12)


def _check_cross_entropy(g, label_smoothing, with_mask):
    v_pad = padded_vocab_size(VOCAB, make_vocab_size_divisible_by=1, tp_size=g.q**2)
    logits = full_tensor((S, B, v_pad), "logits") * 4
    logits[..., VOCAB:] = 1e4  # padding columns must take no probability mass
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(6))
    mask = (full_tensor((S, B), "mask") > 0).float() if with_mask else None
    dloss = full_tensor((S, B), "dloss")
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

    batch, _ = _blocks(g, "inner")
    mine = act_block(logits, g, "inner").requires_grad_()
    record()
    loss = cross_entropy_3d(
        mine, target, g, vocab_size=VOCAB, label_smoothing=label_smoothing, loss_mask=mask
    )
    loss.backward(dloss.chunk(g.q**2, dim=1)[batch])
    sent = sent_bytes()
    RECORDER.disable()
    torch.testing.assert_close(loss, ref.detach().chunk(g.q**2, dim=1)[batch], **TOL)
    grad = torch.cat([ref_logits.grad, torch.zeros(S, B, v_pad - VOCAB)], dim=-1)
    torch.testing.assert_close(mine.grad, act_block(grad, g, "inner"), **TOL)
    expected = cross_entropy3d_bytes(S * B, g.q, label_smoothing=label_smoothing > 0)
    assert sent == pytest.approx(expected, rel=1e-12)


def _all_layer_cases(q):
    g = groups3d(q) if q > 1 else Groups3D.single()
    for layout in ("residual", "inner"):
        for bias in (True, False):
            for stride in (1, 2):
                _check_linear(g, layout, bias, stride)
        for rms in (False, True):
            _check_norm(g, layout, rms)
    _check_embedding(g)
    _check_position(g)
    for ls in (0.0, 0.1):
        for with_mask in (False, True):
            _check_cross_entropy(g, ls, with_mask)
    return True


def test_layers_3d_equal_torch_at_tp8():
    assert run_distributed(_all_layer_cases, 8, 2) == [True] * 8


def test_layers_3d_in_one_process():
    """q = 1 (``Groups3D.single()``): the same code, no communication, zero bytes."""
    assert _all_layer_cases(1)


def test_sizes_that_do_not_divide_are_one_line():
    g = Groups3D(None, None, None, 2, 0, 0, 0)  # q = 2 without ranks: only the checks run
    with pytest.raises(ValueError, match=r"^output_size \(x stride 1\) 6 is not divisible by 4"):
        Linear3D(8, 6, g)
    with pytest.raises(ValueError, match=r"^input_size 5 is not divisible by 2"):
        Linear3D(5, 8, g)
    with pytest.raises(ValueError, match=r"^embedding_dim 6 is not divisible by 4"):
        VocabEmbedding3D(8, 6, g)
    with pytest.raises(ValueError, match=r"^hidden_size 5 is not divisible by 2"):
        LayerNorm3D(5, g)
