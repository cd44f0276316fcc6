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
All times the element size ``e``.
"""

from __future__ import annotations

from megalite.models.config import GPTConfig
from megalite.planning.traffic import Comm


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
    if mode == "3d":
        return _layer_comms_3d(c, tp=tp, tokens=s * b, e=e)
    q = round((tp // depth) ** 0.5)
    tokens = s * b // (depth * q)
    fwd: list[Comm] = []
    bwd: list[Comm] = []
    for i, o, bias in _linears(c):
        for passed in (fwd, bwd):  # the blocks gathered forward and again backward
            passed.append(Comm("all_gather", q, tokens * i * e, tp))
            passed.append(Comm("all_gather", q, o * i // q * e, tp))
        bwd.append(Comm("reduce_scatter", q, tokens * i * e, tp))
        bwd.append(Comm("reduce_scatter", q, o * i // q * e, tp))
        bwd.append(Comm("all_reduce", depth, o * i // (q * q) * e, tp))
        if bias:
            bwd.append(Comm("all_reduce", depth * q, o // q * e, tp))
    layer_norm = c.normalization == "LayerNorm"
    stats = 2 * (2 if layer_norm else 1)  # per layer: two norms, a mean (and a variance) each
    fwd.append(Comm("all_reduce", q, tokens * e, tp, stats))
    bwd.append(Comm("all_reduce", q, tokens * e, tp, stats))
    bwd.append(Comm("all_reduce", depth * q, h // q * e, tp, 2 * (2 if layer_norm else 1)))
    return _kept(fwd), _kept(bwd)


def _layer_comms_3d(c: GPTConfig, *, tp: int, tokens: int, e: int) -> tuple[list, list]:
    """3d (p = q^3, ``layers3d.py``): per linear ``[M, I] -> [M, O]`` the input's rows and the
    weight gathered over q forward (``M I / q^2``, ``O I / q^2``), the output reduce-scattered
    (``M O / q^2``); backward the output grad and the weight gathered again, the input's and the
    weight's grads reduce-scattered, a bias ``[O / q]`` gathered forward and its grad
    reduce-scattered. A norm all-reduces its statistics ``[M / q^2]`` (one per mean) forward and
    backward, and its scales' grads ``[h / q]`` over two sub-axes of q."""
    q = round(tp ** (1 / 3))
    m = tokens // (q * q)  # a rank's block of the tokens; its gathered rows hold q m
    fwd: list[Comm] = []
    bwd: list[Comm] = []
    for i, o, bias in _linears(c):
        fwd.append(Comm("all_gather", q, m * i * e, tp))
        fwd.append(Comm("all_gather", q, o * i // (q * q) * e, tp))
        fwd.append(Comm("reduce_scatter", q, m * o * e, tp))
        bwd.append(Comm("all_gather", q, m * o * e, tp))
        bwd.append(Comm("all_gather", q, o * i // (q * q) * e, tp))
        bwd.append(Comm("reduce_scatter", q, m * i * e, tp))
        bwd.append(Comm("reduce_scatter", q, o * i // (q * q) * e, tp))
        if bias:
            fwd.append(Comm("all_gather", q, o // q * e, tp))
            bwd.append(Comm("reduce_scatter", q, o // q * e, tp))
    per_norm = 2 if c.normalization == "LayerNorm" else 1  # means; scales (LayerNorm: + bias)
    fwd.append(Comm("all_reduce", q, m * e, tp, 2 * per_norm))
    bwd.append(Comm("all_reduce", q, m * e, tp, 2 * per_norm))
    bwd.append(Comm("all_reduce", q, c.hidden_size // q * e, tp, 2 * 2 * per_norm))
    return _kept(fwd), _kept(bwd)


def bytes_per_device(comms: list[Comm]) -> float:
    """What one device sends for ``comms`` in ring collectives (module docstring)."""
    share = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
    return sum(share[x.op] * (x.n - 1) / x.n * x.nbytes * x.count for x in comms)


COLUMN_PARALLEL = (True, False, True, False)  # of _linears' qkv, proj, fc1, fc2 under 1d


def layer_param_elements(c: GPTConfig, *, mode: str, tp: int, depth: int = 1) -> int:
    """One transformer layer's parameter elements on one device. 1d over p ranks: the linears'
    weights and the column-parallel biases split p ways, the row-parallel biases and the norms
    whole. 2d / 2.5d: weights ``[O/q, I/q]`` (every depth holds the same blocks, so a device holds
    ``1/q^2`` of them, ``d`` times 1d's share at the same p), biases and norms ``1/q``."""
    h = c.hidden_size
    norms = 2 * h * (2 if c.normalization == "LayerNorm" else 1)
    linears = _linears(c)
    if mode == "1d":  # qkv and fc1 are column-parallel, proj and fc2 row-parallel
        biases = [o for _, o, bias in linears if bias]
        column = sum(o for (_, o, bias), col in zip(linears, COLUMN_PARALLEL) if bias and col)
        weights = sum(o * i for i, o, _ in linears) // tp
        return weights + column // tp + (sum(biases) - column) + norms
    if mode == "3d":  # weights [O/q^2, I/q], biases [O/q^2], norm scales [h/q]
        q = round(tp ** (1 / 3))
        weights = sum(o * i for i, o, _ in linears) // q**3
        return weights + sum(o for _, o, bias in linears if bias) // (q * q) + norms // q
    q = round((tp // depth) ** 0.5)
    weights = sum(o * i for i, o, _ in linears) // (q * q)
    return weights + sum(o for _, o, bias in linears if bias) // q + norms // q
