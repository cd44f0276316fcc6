"""Blocks with sequence parallel on and off, the RNG tracker, recompute replay, and bad inputs.

Oracle: the same block built from plain torch modules (nn.Linear, F.layer_norm / the RMSNorm
reference) on the unsharded weights, sliced with ``chunk``. fp32, rtol 1e-5 / atol 1e-6 (only the
order of reductions differs).

With the fused Triton kernels on (a CUDA run, or ``TRITON_INTERPRET=1`` on CPU) the norm weight
grads, and fc1's weight grad (a sum over the same rows of products with the fused norm's output),
get a bound derived from the kernel's numerics instead (``_norm_weight_grad_atol``); every other
tensor, and every tensor with the kernels off, keeps rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.core import fusions
from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads
from megalite.core.norms import build_norm
from megalite.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    model_parallel_seed,
    scatter_to_sp_region,
)
from megalite.core.tensor_parallel.init import init_normal
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
S, B, H, FFN = 8, 2, 8, 16


def _full(shape, key):
    w = torch.empty(shape)
    init_normal(0.5, seed=3, key=key)(w)
    return w


class _Block(nn.Module):
    """norm -> column -> GELU -> row -> norm, megalite layers."""

    def __init__(self, ps, sp, norm, with_norms):
        super().__init__()
        g = ps.tp_group
        self.with_norms = with_norms
        self.norm1 = build_norm(norm, H, eps=1e-5, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(
            H,
            FFN,
            tp_group=g,
            sequence_parallel=sp,
            init_method=init_normal(0.5, seed=3, key="fc1"),
        )
        self.fc2 = RowParallelLinear(
            FFN,
            H,
            tp_group=g,
            sequence_parallel=sp,
            init_method=init_normal(0.5, seed=3, key="fc2"),
        )
        self.norm2 = build_norm(norm, H, eps=1e-5, sequence_parallel=sp)
        with torch.no_grad():  # non-trivial norm parameters, so their grads mean something
            self.norm1.weight.copy_(1 + _full((H,), "n1"))
            self.norm2.weight.copy_(1 + _full((H,), "n2"))
            self.fc2.bias.copy_(_full((H,), "b2"))

    def forward(self, x):
        if self.with_norms:
            x = self.norm1(x)
        y, _ = self.fc1(x)
        y, _ = self.fc2(F.gelu(y))
        return self.norm2(y) if self.with_norms else y


U32 = 2.0**-24  # fp32 unit roundoff


def _norm_weight_grad_atol(terms: torch.Tensor, rows: int) -> torch.Tensor:
    """Absolute tolerance of a norm weight grad computed by the fused kernel, per element.

    dweight_j = sum over the ``rows`` rows i of dy_ij * xhat_ij. The oracle (torch's autograd)
    sums these fp32 products in one order; the fused backward sums them per program into partial
    rows (``reduction_programs``: 4 programs under the interpreter, 2 per SM on CUDA), then sums
    the partials, and under SP the TP all-reduce adds the ranks' partials: another order. Any
    order of a fp32 sum of m terms is within (m - 1) u sum|t| of the exact sum (u = 2^-24), so two
    orders differ by at most 2 (m - 1) u sum|t|. Each term also differs by a few roundings in
    xhat (the kernel centres in two steps and uses rsqrt; torch divides by sqrt): at most 3 u |t|
    each side, 6 u sum|t| together. Hence |fused - oracle| <= (2 (m - 1) + 6) u sum_i |dy_ij
    xhat_ij|, with ``terms`` = that sum taken from the oracle. The upstream error in dy (norm1's
    dy passes through norm2's fused backward) is what the shared atol 1e-6 / rtol 1e-5 already
    bound for the activation grads, so it is kept on top.
    """
    return TOL["atol"] + (2 * (rows - 1) + 6) * U32 * terms


def _assert_norm_grad(actual, expected, terms, fused):
    if not fused:  # the reference path keeps the shared tolerance
        torch.testing.assert_close(actual, expected, **TOL)
        return
    bound = _norm_weight_grad_atol(terms, S * B) + TOL["rtol"] * expected.abs()
    err = (actual - expected).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"norm weight grad off by {err[worst]:.3g} at {worst}, derived bound {bound[worst]:.3g}"
    )


def _xhat(norm, t):
    t = t.detach()
    if norm == "LayerNorm":
        t = t - t.mean(-1, keepdim=True)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)


def _oracle(norm, with_norms, x, dy):
    fc1, fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    w1, w2 = (1 + _full((H,), "n1")).requires_grad_(), (1 + _full((H,), "n2")).requires_grad_()
    with torch.no_grad():
        fc1.weight.copy_(_full((FFN, H), "fc1"))
        fc1.bias.zero_()
        fc2.weight.copy_(_full((H, FFN), "fc2"))
        fc2.bias.copy_(_full((H,), "b2"))

    def n(t, w):
        if norm == "LayerNorm":
            return F.layer_norm(t, (H,), w, torch.zeros(H), 1e-5)
        return fusions.rms_norm(t, w, 1e-5, use_fused=False)

    x = x.clone().requires_grad_()
    h = n(x, w1) if with_norms else x
    if with_norms:
        h.retain_grad()
    u = fc1(h)
    u.retain_grad()
    z = fc2(F.gelu(u))
    y = n(z, w2) if with_norms else z
    y.backward(dy)
    terms = (None, None, None)
    if with_norms:  # sum over rows of |dy * xhat| per hidden unit: what the weight grads sum
        terms = tuple(
            (g * _xhat(norm, t)).abs().reshape(-1, H).sum(0) for g, t in ((h.grad, x), (dy, z))
        )
        # fc1's weight grad sums its output grad times norm1's output over the same rows
        terms += (u.grad.abs().reshape(-1, FFN).t() @ h.detach().abs().reshape(-1, H),)
    return (y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad, w1.grad, w2.grad, *terms)


def _block_cases(tp):
    ps = mesh(tp, 1)
    r = ps.tp_rank
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    for norm in ("LayerNorm", "RMSNorm"):
        for with_norms in (False, True):
            oracle = _oracle(norm, with_norms, x, dy)
            y_ref, dx_ref, dw1_ref, dw2_ref, dn1_ref, dn2_ref, terms1, terms2, terms_fc1 = oracle
            fused = fusions._use_triton(x, True)
            outs = {}
            for sp in (False, True):
                block = _Block(ps, sp, norm, with_norms)
                xin = (x.chunk(tp, 0)[r] if sp else x).clone().requires_grad_()
                y = block(xin)
                y.backward(dy.chunk(tp, 0)[r] if sp else dy)
                all_reduce_sequence_parallel_grads(block.parameters(), ps.tp_group)
                shard = (lambda t: t.chunk(tp, 0)[r]) if sp else (lambda t: t)
                torch.testing.assert_close(y, shard(y_ref), **TOL)
                torch.testing.assert_close(xin.grad, shard(dx_ref), **TOL)
                if with_norms and fused:  # its input is the fused norm1's output
                    _assert_norm_grad(
                        block.fc1.weight.grad,
                        dw1_ref.chunk(tp, 0)[r],
                        terms_fc1.chunk(tp, 0)[r],
                        fused,
                    )
                else:
                    torch.testing.assert_close(
                        block.fc1.weight.grad, dw1_ref.chunk(tp, 0)[r], **TOL
                    )
                torch.testing.assert_close(block.fc2.weight.grad, dw2_ref.chunk(tp, 1)[r], **TOL)
                if with_norms:  # SP: after the TP all-reduce of the shard grads
                    _assert_norm_grad(block.norm1.weight.grad, dn1_ref, terms1, fused)
                    _assert_norm_grad(block.norm2.weight.grad, dn2_ref, terms2, fused)
                outs[sp] = (y.detach(), block.norm2.weight.grad)
            # on and off agree with each other as well
            torch.testing.assert_close(outs[True][0], outs[False][0].chunk(tp, 0)[r], **TOL)
    return True


@pytest.mark.kernels_on  # also run with the fused kernels forced on (scripts/test.sh)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mlp_and_norm_blocks_equal_with_sequence_parallel_on_and_off(tp):
    assert run_distributed(_block_cases, tp, tp) == [True] * tp


def _saved_shapes(tp):
    ps = mesh(tp, 1)
    fc1 = ColumnParallelLinear(
        H,
        FFN,
        tp_group=ps.tp_group,
        sequence_parallel=True,
        init_method=init_normal(0.5, seed=3, key="fc1"),
    )
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    xin = x.chunk(tp, 0)[ps.tp_rank].clone().requires_grad_()
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = fc1(xin)
    y.sum().backward()  # backward gathers the shard again: the grads are the oracle's
    w = _full((FFN, H), "fc1")  # the unsharded weight: every rank's output grad is ones
    torch.testing.assert_close(
        fc1.weight.grad,
        torch.ones(S, B, FFN // tp).reshape(-1, FFN // tp).t().mm(x.reshape(-1, H)),
        **TOL,
    )
    torch.testing.assert_close(xin.grad, torch.ones(S // tp, B, FFN) @ w, **TOL)
    return shapes


def test_column_parallel_saves_only_the_sequence_shard():
    """Under SP a column-parallel linear saves its [s/tp, b, h] input, not the gathered [s, b, h]
    (Megatron's memory trade: one more all-gather in backward)."""
    for shapes in run_distributed(_saved_shapes, 2, 2):
        assert (S // 2, B, H) in shapes and (S, B, H) not in shapes, shapes


def _dropout_masks(tp):
    ps = mesh(tp, 1)
    tracker = model_parallel_seed(1234, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)
    ones = torch.ones(64)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside_again = F.dropout(ones, 0.5)
    return ps.tp_rank, ps.dp_rank, inside, outside, inside_again


def test_rng_tracker_differs_across_tp_and_agrees_across_dp():
    res = run_distributed(_dropout_masks, 4, 2)  # tp=2, dp=2
    by = {(t, d): (i, o, i2) for t, d, i, o, i2 in res}
    for d in (0, 1):
        assert not torch.equal(by[(0, d)][0], by[(1, d)][0]), "TP ranks share a TP-region mask"
        assert torch.equal(by[(0, d)][1], by[(1, d)][1]), "TP ranks differ outside TP regions"
    for t in (0, 1):
        assert torch.equal(by[(t, 0)][0], by[(t, 1)][0]), "DP ranks differ in a TP region"
        assert torch.equal(by[(t, 0)][2], by[(t, 1)][2])
    # the forked stream advances: its second draw differs from its first
    assert not torch.equal(by[(0, 0)][0], by[(0, 0)][2])


def _recompute_replays_dropout():
    tracker = model_parallel_seed(5, tp_rank=0, pp_rank=0)
    lin = nn.Linear(8, 8)

    def f(x):
        with tracker.fork():
            x = F.dropout(lin(x), 0.3)
        return F.dropout(torch.tanh(x), 0.3)

    x = torch.randn(4, 8)
    grads, outs = [], []
    for use_recompute in (False, True):
        torch.manual_seed(11)
        tracker = model_parallel_seed(5, tp_rank=0, pp_rank=0)
        lin.zero_grad()
        xi = x.clone().requires_grad_()
        y = (
            checkpoint(f, xi, tracker=tracker, device=torch.device("cpu"))
            if use_recompute
            else f(xi)
        )
        # draws between forward and backward must not leak into the recomputation
        torch.rand(100)
        with tracker.fork():
            torch.rand(100)
        y.sum().backward()
        outs.append(y.detach())
        grads.append((xi.grad, lin.weight.grad.clone()))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_recompute_replays_dropout_masks_bitwise():
    _recompute_replays_dropout()


def _bad_inputs():
    ps = mesh(2, 1)
    g = ps.tp_group
    errors = []
    for build in (
        lambda: ColumnParallelLinear(4, 7, tp_group=g),
        lambda: RowParallelLinear(5, 4, tp_group=g),
        lambda: VocabParallelEmbedding(0, 4, tp_group=g),
        lambda: VocabParallelEmbedding(10, 4, tp_group=g, make_vocab_size_divisible_by=0),
        lambda: scatter_to_sp_region(torch.zeros(5, 1, 4), g),
        lambda: ColumnParallelLinear(4, 8, tp_group=g, sequence_parallel=True, gather_output=True),
    ):
        try:
            build()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_inputs_give_one_line_errors_with_the_numbers():
    errors = run_distributed(_bad_inputs, 2)[0]
    expected = [
        "output size 7 is not divisible by the tensor-parallel size 2",
        "input size 5 is not divisible by the tensor-parallel size 2",
        "vocabulary size must be >= 1, got 0",
        "make_vocab_size_divisible_by must be >= 1, got 0",
        "sequence dim 5 is not divisible by the TP size 2",
        "gather_output is not allowed with sequence_parallel",
    ]
    for err, want in zip(errors, expected, strict=True):
        assert err is not None and want in err and "\n" not in err, (err, want)
