"""3D tensor-parallel layers: the linear layer (the 3D matmul and its backward) and the norms.

The cube (``grid3d.py``): p = q^3 ranks with coordinates (input, weight, output). Activations are
``[s, b, h]`` as everywhere in megalite; 3D splits the batch dim ``b`` in q^2 blocks and the hidden
dim in q blocks (the sequence stays whole, so attention and RoPE are local). Two layouts:

    layout     batch block of q^2 held     hidden block of q held   used for
    residual   weight_rank * q + input     output_rank              residual stream, norms, the
                                                                    embedding and block outputs
    inner      weight_rank * q + output    input_rank               QKV, attention, the ffn dim,
                                                                    logits

A rank holds ``[s, b/q^2, h/q]``: 1/q^3 of the activation, nothing replicated. ``Linear3D`` maps
one layout to the other (from ``residual`` it is the column-parallel step, from ``inner`` the
row-parallel one), so a transformer block reads residual -> inner -> residual twice and needs no
other collective than its norms'. For a linear ``[M, K] x [K, N]`` taking layout ``L`` (M tokens;
"row group" = the sub-axis spreading L's batch sub-blocks, "hidden group" = the one splitting L's
hidden dim; residual: input / output, inner: output / input):

    weight  [N, K] (torch's [out, in]) held as rows block (row_rank * q + weight_rank) of q^2 (of
            each of ``stride`` stacked blocks), columns block hidden_rank of q: [N/q^2, K/q]
    fwd     x = all-gather(x, row group, batch)        [s, b/q, K/q]
            W = all-gather(W, weight group, rows)       [N/q, K/q]
            y = reduce-scatter(x W^T, hidden group, batch) + bias  [s, b/q^2, N/q], the other layout
    bwd     dy = all-gather(dy, hidden group, batch); W re-gathered (weights are not kept gathered)
            dx = reduce-scatter(dy W, row group, batch)
            dW = reduce-scatter(dy^T x, weight group, rows); db likewise from dy summed over tokens

The bias ``[N]`` is held as ``[N/q^2]`` (the weight's rows block), gathered over the weight group;
its q copies along the hidden group get equal grads. A norm over a split hidden dim all-reduces its
statistics (``[s, b/q^2, 1]``) over the hidden group; its weight ``[h/q]`` is replicated over the
other two sub-axes and its grad all-reduced over both in backward.

Bytes per device (``e`` bytes per element; a ring all-gather or reduce-scatter of a ``T``-element
whole sends ``(q-1)/q T e`` per rank, an all-reduce ``2(q-1)/q T e``), per micro-batch, fwd + bwd:

    Linear3D K -> N      (q-1)/q^3 (2MK + 2MN + 3KN) e   + 2(q-1)/q^2 N e with a bias
    LayerNorm3D          8(q-1)/q^3 M e + 8(q-1)/q^2 h e
    RMSNorm3D            4(q-1)/q^3 M e + 4(q-1)/q^2 h e
    VocabEmbedding3D     2(q-1)/q^3 (V h + M h) e
    PositionEmbedding3D  4(q-1)/q^2 s h e
    cross_entropy_3d     6(q-1)/q^3 M e  (8 with label smoothing)

(``cost3d.py`` computes them; 1D TP moves ~4(p-1)/p M h e per linear pair whatever p.)
Activation bytes per device: a block's input and output ``M h / q^3`` each; a Linear3D saves its
gathered input ``M K / q^2`` for backward (q x its own input, the price of not re-gathering it).

Each parameter carries ``tp3d_replicated_over`` (``mark3d``): the sub-axes holding equal copies
of it (a bias: its input layout's hidden axis; a norm's weight: the other two), so a grad norm
counts it once (``Groups3D.holds_first_copy``); no grad needs a further reduction over TP.

Initialisation is keyed: each rank builds the full weight from ``init_method`` (seed and name) on
CPU in fp32 and keeps its block, so the layer equals the unsharded one whatever q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.tensor_parallel.init import InitMethod, default_init
from megalite.core.tensor_parallel.modes.comm3d import (
    all_reduce_sum,
    copy_to_group,
    gather_dim,
    reduce_scatter_dim,
    reduce_scatter_grad,
)
from megalite.core.tensor_parallel.modes.grid3d import Groups3D, first_copy_ranks, other_layout

BATCH_DIM = 1  # activations are [s, b, h]


def mark3d(param: nn.Parameter, replicated_over: tuple[str, ...], groups: Groups3D) -> nn.Parameter:
    """Set ``tp3d_replicated_over``: the sub-axes along which ``param`` has equal copies (with
    equal grads: the layers sum them in backward); ``Groups3D.holds_first_copy`` reads it. Also
    ``distinct_tp_ranks`` (``param_attributes``), the grid modes' one rule for the grad norm: the
    TP ranks holding the first copy."""
    param.tp3d_replicated_over = replicated_over
    param.distinct_tp_ranks = first_copy_ranks(replicated_over, groups.q)
    return param


def check_divides(value: int, by: int, *, what: str) -> None:
    if value % by:
        raise ValueError(f"{what} {value} is not divisible by {by} (3D tensor parallelism)")


def weight_block3d(
    full: torch.Tensor, g: Groups3D, layout: str, *, stride: int = 1
) -> torch.Tensor:
    """This rank's block of a full ``[N, K]`` weight of a Linear3D taking ``layout`` (also a
    ``[N]`` bias: the rows block alone)."""
    q, rows = g.q, g.row_rank(layout) * g.q + g.weight_rank
    blocks = [b.chunk(q * q, dim=0)[rows] for b in full.chunk(stride, dim=0)]
    out = torch.cat(blocks, dim=0)
    return out if full.dim() == 1 else out.chunk(q, dim=1)[g.hidden_rank(layout)]


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, g: Groups3D, layout: str, stride: int):
        row_group, hidden_group = g.row_group(layout), g.hidden_group(layout)
        x_rows = gather_dim(x, BATCH_DIM, row_group, what="3d input")  # [s, b/q, K/q]
        w = gather_dim(weight, 0, g.weight_group, stride=stride, what="3d weight")  # [N/q, K/q]
        y = reduce_scatter_dim(
            F.linear(x_rows, w), BATCH_DIM, hidden_group, what="3d output"
        )  # [s, b/q^2, N/q]
        if bias is not None:
            y = y + gather_dim(bias, 0, g.weight_group, stride=stride, what="3d bias")
        ctx.save_for_backward(x_rows, weight)
        ctx.g, ctx.layout, ctx.stride, ctx.has_bias = g, layout, stride, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight = ctx.saved_tensors
        g, stride = ctx.g, ctx.stride
        row_group, hidden_group = g.row_group(ctx.layout), g.hidden_group(ctx.layout)
        dy_rows = gather_dim(dy, BATCH_DIM, hidden_group, what="3d output grad")  # [s, b/q, N/q]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w = gather_dim(weight, 0, g.weight_group, stride=stride, what="3d weight")
            dx = reduce_scatter_dim(dy_rows @ w, BATCH_DIM, row_group, what="3d input grad")
        if ctx.needs_input_grad[1]:
            dw_part = dy_rows.flatten(0, 1).t() @ x_rows.flatten(0, 1)  # [N/q, K/q]
            dw = reduce_scatter_grad(
                dw_part, 0, g.weight_group, stride=stride, what="3d weight grad"
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = reduce_scatter_grad(
                dy_rows.sum(dim=(0, 1)), 0, g.weight_group, stride=stride, what="3d bias grad"
            )
        return dx, dw, db, None, None, None


class Linear3D(nn.Module):
    """``y = x W^T + b`` under 3D TP. Input # [s, b/q^2, in/q] in ``input_layout``; output
    # [s, b/q^2, out/q] in the other layout. ``stride`` > 1: the full weight is ``stride`` stacked
    blocks (SwiGLU's ``[gate; up]``) and a local ``chunk(stride, -1)`` of the output gives them."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        groups: Groups3D,
        *,
        input_layout: str = "residual",
        bias: bool = True,
        stride: int = 1,
        init_method: InitMethod = default_init,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        q = groups.q
        check_divides(input_size, q, what="input_size")
        check_divides(output_size, q * q * stride, what=f"output_size (x stride {stride})")
        self.groups, self.input_layout, self.stride = groups, input_layout, stride
        self.output_layout = other_layout(input_layout)
        full = torch.zeros(output_size, input_size, dtype=torch.float32)
        init_method(full)
        block = weight_block3d(full, groups, input_layout, stride=stride)
        self.weight = mark3d(
            nn.Parameter(block.to(device=device, dtype=params_dtype).contiguous()), (), groups
        )
        self.bias = None
        if bias:  # zero at init, as Megatron's linear biases; equal along the hidden axis
            zeros = torch.zeros(output_size // (q * q), dtype=params_dtype, device=device)
            self.bias = mark3d(nn.Parameter(zeros), (groups.hidden_axis(input_layout),), groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear3D.apply(
            x, self.weight, self.bias, self.groups, self.input_layout, self.stride
        )


class _Norm3D(nn.Module):
    """Shared by the norms: the weight (and bias) ``[h/q]``, this rank's hidden block, replicated
    over the two sub-axes that split the rows; their grads are summed over both in backward."""

    has_bias = False  # LayerNorm's shift

    def __init__(
        self,
        hidden_size: int,
        groups: Groups3D,
        *,
        eps: float = 1e-5,
        layout: str = "residual",
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        check_divides(hidden_size, groups.q, what="hidden_size")
        self.groups, self.layout, self.eps, self.hidden_size = groups, layout, eps, hidden_size
        local = hidden_size // groups.q
        copies = (groups.row_axis(layout), "weight")
        self.weight = mark3d(
            nn.Parameter(torch.ones(local, dtype=params_dtype, device=device)), copies, groups
        )
        self.bias = None
        if self.has_bias:
            zeros = torch.zeros(local, dtype=params_dtype, device=device)
            self.bias = mark3d(nn.Parameter(zeros), copies, groups)

    def _replicated(self, p: torch.Tensor) -> torch.Tensor:
        g = self.groups
        p = copy_to_group(p, g.row_group(self.layout), what="3d norm param grad")
        return copy_to_group(p, g.weight_group, what="3d norm param grad")

    def _hidden_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the whole hidden dim # [s, b/q^2, 1]."""
        group = self.groups.hidden_group(self.layout)
        return all_reduce_sum(x.sum(dim=-1, keepdim=True), group, what="3d norm stats")


class LayerNorm3D(_Norm3D):
    """LayerNorm over a hidden dim split in q blocks. Input and output # [s, b/q^2, h/q]."""

    has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # in fp32, scale and shift included, as F.layer_norm computes
        centred = x32 - self._hidden_sum(x32) / self.hidden_size
        var = self._hidden_sum(centred * centred) / self.hidden_size
        y = centred * torch.rsqrt(var + self.eps)
        y = y * self._replicated(self.weight).float() + self._replicated(self.bias).float()
        return y.to(x.dtype)


class RMSNorm3D(_Norm3D):
    """RMSNorm over a hidden dim split in q blocks. Input and output # [s, b/q^2, h/q]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # normalised in fp32, cast back, then scaled, as fusions.rms_norm
        mean_sq = self._hidden_sum(x32 * x32) / self.hidden_size
        y = (x32 * torch.rsqrt(mean_sq + self.eps)).to(x.dtype)
        return self._replicated(self.weight) * y
