"""Each tensor-parallel mode's communication for one transformer layer, in closed form.

    fwd, bwd = layer_comms(c, mode="2.5d", tp=8, depth=2, micro_batch_size=4, e=4)
    per_device = bytes_per_device(fwd + bwd)
    layer_param_elements(c, mode="2d", tp=4)    # a layer's parameters on one device

The ``Comm`` records are those ``measure.comm_log.CommLog`` counts on a rank (an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor); ``bytes_per_device`` charges each
with what one device sends in a ring: ``(n - 1) / n`` of the tensor for an all-gather or a
reduce-scatter over n ranks, twice that for an all-reduce.

With ``T`` tokens per device and each linear ``L`` mapping ``I_L`` to ``O_L`` features (the layer's
four: qkv, proj, fc1, fc2), one forward and backward of a layer costs per device:

- 1d over p ranks (no sequence parallel): four all-reduces of ``[s, b, h]`` (T = s b):
  ``4 * 2 (p - 1) / p * T h``
- 2d (p = q^2) and 2.5d (p = d q^2; 2d is d = 1), T = s b / (d q): per linear the input gathered
  over the grid row and the weight over the grid column forward and again backward (only the
  blocks are saved), their grads reduce-scattered backward, and the weight grad all-reduced over
  depth: ``sum_L [3 (q - 1) / q * (T I_L + O_L I_L / q) + 2 (d - 1) / d * O_L I_L / q^2]``
  plus the norms' statistics (one all-reduce of ``[T]`` over q per mean each way) and the grads
  of the biases and norm scales (an all-reduce of ``[O_L / q]`` over d q).
- 3d (p = q^3), M = s b tokens: per linear ``(q - 1) / q^3 (2 M I_L + 2 M O_L + 3 O_L I_L)``
  (``cost3d.linear3d_bytes``), plus the norms' statistics and scale grads and the biases'
  gathers (``_layer_comms_3d``).
All times the element size ``e``, except the sums of weight, bias and norm-scale grads and the
norms' statistics, which run in fp32 (4 bytes) whatever the dtype.

Links: each record's ``span`` is the consecutive global ranks its sub-group covers (a TP group is
consecutive ranks, ``tp_rank = col + q (row + q depth)`` on a grid, ``input + q (weight + q
output)`` in the cube), so a step-time model charges it the link it crosses: on a grid the
activations' collectives stay inside a grid row (``q`` consecutive ranks), the weights' cross a
grid column (``q^2``), only depth and the replicated grads span the group; in the cube the input
sub-axis spans ``q``, the weight ``q^2``, the output ``q^3``. 1d spans its whole group.

``mode_pass_traffic`` adds a stage's ends to its layers (the output layer as a linear ``h -> V``
in the mode's product, the embedding's and the cross entropy's collectives) and full recompute's
repeated forward: what ``traffic.pass_traffic`` charges under a grid or the cube.
"""

from __future__ import annotations

from megalite.models.config import GPTConfig
from megalite.planning.comm import Comm
from megalite.planning.tp_split import TPSplit

COLUMN_PARALLEL = (True, False, True, False)  # of _linears' qkv, proj, fc1, fc2 under 1d


FP32 = 4  # bytes of the sums the grid and the cube run in fp32 whatever ``e``: weight, bias and
# norm-scale grads (summed over ranks holding other samples) and the norms' statistics


def _kept(comms: list[Comm]) -> list[Comm]:
    """Without the collectives over one rank (they return at once, nothing is sent)."""
    return [x for x in comms if x.n > 1 and x.nbytes > 0]


def _linears(c: GPTConfig) -> list[tuple[int, int, bool]]:
    """(in, out, bias) of a layer's four linears: qkv, proj, fc1, fc2."""
    n, g, d, h, f = (
        c.num_attention_heads,
        c.num_query_groups,
        c.kv_channels,
        c.hidden_size,
        c.ffn_hidden_size,
    )
    bias = c.add_bias_linear
    return [
        (h, (n + 2 * g) * d, bias or c.add_qkv_bias),
        (n * d, h, bias),
        (h, 2 * f if c.swiglu else f, bias),
        (f, h, bias),
    ]


def layer_comms(
    c: GPTConfig, *, mode: str, tp: int, depth: int = 1, micro_batch_size: int, e: int
) -> tuple[list[Comm], list[Comm]]:
    """(forward, backward) collectives of one transformer layer on one device (module docstring),
    for 1d (no sequence parallel), 2d, 2.5d and 3d."""
    s, h, b = c.seq_length, c.hidden_size, micro_batch_size
    if mode == "1d":
        act = s * b * h * e
        return _kept([Comm("all_reduce", tp, act, tp, 2)]), _kept(
            [Comm("all_reduce", tp, act, tp, 2)]
        )
    split = TPSplit(mode, tp, depth)
    tokens = s * b
    fwd: list[Comm] = []
    bwd: list[Comm] = []
    for (i, o, bias), column in zip(_linears(c), COLUMN_PARALLEL):
        f, bk = linear_comms(split, i, o, bias=bias, tokens=tokens, e=e, residual_input=column)
        fwd += f
        bwd += bk
    f, bk = _norm_comms(c, split, tokens=tokens, e=e, count=2)
    return _kept(fwd + f), _kept(bwd + bk)


def linear_comms(
    split: TPSplit, i: int, o: int, *, bias: bool, tokens: int, e: int, residual_input: bool
) -> tuple[list[Comm], list[Comm]]:
    """(forward, backward) of one grid or cube linear ``[tokens, i] -> [tokens, o]`` (the
    micro-batch's ``tokens``); ``residual_input``: in the cube, its input is in the residual
    layout (qkv, fc1, the output layer) rather than the inner one (proj, fc2)."""
    q, tp, depth = split.q, split.tp, split.depth
    fwd: list[Comm] = []
    bwd: list[Comm] = []
    if split.mode == "3d":
        m = tokens // (q * q)  # a rank's block of the tokens; its gathered rows hold q m
        w = o * i // (q * q) * e
        dw = o * i // (q * q) * FP32  # the weight grad's sum runs in fp32
        rows, hidden = (q, q**3) if residual_input else (q**3, q)  # input, output sub-axes
        fwd.append(Comm("all_gather", q, m * i * e, rows))
        fwd.append(Comm("all_gather", q, w, q * q))
        fwd.append(Comm("reduce_scatter", q, m * o * e, hidden))
        bwd.append(Comm("all_gather", q, m * o * e, hidden))
        bwd.append(Comm("all_gather", q, w, q * q))
        bwd.append(Comm("reduce_scatter", q, m * i * e, rows))
        bwd.append(Comm("reduce_scatter", q, dw, q * q))
        if bias:
            fwd.append(Comm("all_gather", q, o // q * e, q * q))
            bwd.append(Comm("reduce_scatter", q, o // q * FP32, q * q))
        return fwd, bwd
    t = tokens // (depth * q)
    for passed in (fwd, bwd):  # the blocks gathered forward and again backward
        passed.append(Comm("all_gather", q, t * i * e, q))  # over the grid row
        passed.append(Comm("all_gather", q, o * i // q * e, q * q))  # over the grid column
    bwd.append(Comm("reduce_scatter", q, t * i * e, q))
    bwd.append(Comm("reduce_scatter", q, o * i // q * FP32, q * q))  # weight grads: in fp32
    bwd.append(Comm("all_reduce", depth, o * i // (q * q) * FP32, tp))
    if bias:
        bwd.append(Comm("all_reduce", depth * q, o // q * FP32, tp))
    return fwd, bwd


def _norm_comms(
    c: GPTConfig, split: TPSplit, *, tokens: int, e: int, count: int
) -> tuple[list[Comm], list[Comm]]:
    """``count`` norms of a grid or the cube: their statistics (a mean, and LayerNorm's variance,
    each way) over the hidden dim's sub-group, and backward their scales' (and shifts') grads
    over the copies."""
    q, tp = split.q, split.tp
    per_norm = 2 if c.normalization == "LayerNorm" else 1
    stats = count * per_norm
    h = c.hidden_size // q * FP32  # statistics and scale grads are summed in fp32
    if split.mode == "3d":  # statistics over the residual layout's hidden (output) sub-axis;
        m = tokens // (q * q) * FP32  # scale grads over its rows (input) and the weight sub-axis
        fwd = [Comm("all_reduce", q, m, q**3, stats)]
        bwd = [Comm("all_reduce", q, m, q**3, stats), Comm("all_reduce", q, h, q, stats)]
        return fwd, bwd + [Comm("all_reduce", q, h, q * q, stats)]
    t = tokens // (split.depth * q) * FP32
    fwd = [Comm("all_reduce", q, t, q, stats)]
    return fwd, [
        Comm("all_reduce", q, t, q, stats),
        Comm("all_reduce", split.depth * q, h, tp, stats),
    ]


def mode_pass_traffic(
    c: GPTConfig,
    split: TPSplit,
    *,
    micro_batch_size: int,
    n_layers: int,
    recomputed: int,
    first: bool,
    last: bool,
    e: int,
) -> tuple[list[Comm], list[Comm]]:
    """(forward, backward) tensor-parallel collectives of one micro-batch through a stage of
    ``n_layers`` under a grid or the cube (module docstring); ``recomputed``: the layers whose
    forward full recompute repeats in backward."""
    tokens = c.seq_length * micro_batch_size
    fwd1, bwd1 = layer_comms(
        c, mode=split.mode, tp=split.tp, depth=split.depth, micro_batch_size=micro_batch_size, e=e
    )
    fwd = [_times(x, n_layers) for x in fwd1]
    bwd = [_times(x, n_layers) for x in bwd1] + [_times(x, recomputed) for x in fwd1]
    q = split.q
    t = tokens // split.batch_blocks
    if first:  # the embedding: its lookups summed over the vocabulary blocks (a grid column's
        h = c.hidden_size // q  # reduce-scatter; the cube's over its rows), the grad gathered
        fwd.append(Comm("reduce_scatter", q, q * t * h * e, q * q))
        bwd.append(Comm("all_gather", q, q * t * h * e, q * q))
    if last:
        vocab = split.vocab(c) * q
        f, bk = linear_comms(
            split, c.hidden_size, vocab, bias=False, tokens=tokens, e=e, residual_input=True
        )
        nf, nb = _norm_comms(c, split, tokens=tokens, e=e, count=1)  # the final norm
        fwd += f + nf + [Comm("all_reduce", q, t * 4, q, 3)]  # the cross entropy's statistics
        bwd += bk + nb
    return _kept(fwd), _kept(bwd)


def _times(x: Comm, k: float) -> Comm:
    return Comm(x.op, x.n, x.nbytes, x.span, x.count * k)


def bytes_per_device(comms: list[Comm]) -> float:
    """What one device sends for ``comms`` in ring collectives (module docstring)."""
    share = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
    return sum(share[x.op] * (x.n - 1) / x.n * x.nbytes * x.count for x in comms)


def layer_param_elements(c: GPTConfig, *, mode: str, tp: int, depth: int = 1) -> int:
    """One transformer layer's parameter elements on one device (``tp_split.TPSplit``): 1d over
    p ranks: the linears' weights and the column-parallel biases split p ways, the row-parallel
    biases and the norms whole. 2d / 2.5d: weights ``[O/q, I/q]`` (every depth holds the same
    blocks, so a device holds ``1/q^2`` of them, ``d`` times 1d's share at the same p), biases
    and norms ``1/q``. 3d: weights ``[O/q^2, I/q]``, biases ``[O/q^2]``, norms ``[h/q]``."""
    split = TPSplit(mode, tp, depth)
    per_norm = 2 if c.normalization == "LayerNorm" else 1
    total = 2 * per_norm * split.norm(c.hidden_size)
    for (i, o, bias), column in zip(_linears(c), COLUMN_PARALLEL):
        weight, bias_numel = split.linear(o, i, column=column)
        total += weight + (bias_numel if bias else 0)
    return total
