"""Bytes each rank sends per micro-batch (forward + backward) in the 3D layers, in closed form,
and the activation bytes a 3D linear keeps for backward.

Convention: a ring all-gather or reduce-scatter over q ranks whose whole (gathered, or not yet
reduced) tensor holds ``T`` elements sends ``(q-1)/q * T`` elements per rank; an all-reduce of
``T`` elements sends ``2(q-1)/q * T``. ``tokens`` is ``M = s * b`` of the micro-batch (the whole
batch, not a rank's block). The derivations are in ``layers3d.py`` and ``vocab3d.py``; the
planner and the tests read these. Every function returns bytes (``elem_bytes`` per element).
"""

from __future__ import annotations


def linear3d_bytes(
    tokens: int, input_size: int, output_size: int, q: int, *, bias: bool, elem_bytes: int = 4
) -> float:
    """``Linear3D`` K -> N: (q-1)/q^3 (2MK + 2MN + 3KN), + 2(q-1)/q^2 N with a bias."""
    m, k, n = tokens, input_size, output_size
    out = (q - 1) / q**3 * (2 * m * k + 2 * m * n + 3 * k * n)
    if bias:
        out += 2 * (q - 1) / q**2 * n
    return out * elem_bytes


def linear3d_activation_bytes(
    tokens: int, input_size: int, q: int, *, elem_bytes: int = 4
) -> float:
    """What a ``Linear3D`` keeps for backward besides its weight: its input gathered over the row
    group, ``[s, b/q, K/q]``: M K / q^2 (q x the ``M K / q^3`` a rank holds of the input)."""
    return tokens * input_size / q**2 * elem_bytes


def norm3d_bytes(tokens: int, hidden_size: int, q: int, *, rms: bool, elem_bytes: int = 4) -> float:
    """LayerNorm3D: two statistics all-reduces forward and two backward (``[M/q^2]`` each), weight
    and bias grads all-reduced (``[h/q]``) over two sub-axes: 8(q-1)/q^3 M + 8(q-1)/q^2 h.
    RMSNorm3D: one statistic and one parameter: half of that."""
    factor = 4 if rms else 8
    return factor * (q - 1) * (tokens / q**3 + hidden_size / q**2) * elem_bytes


def embedding3d_bytes(
    tokens: int, vocab_size: int, hidden_size: int, q: int, *, elem_bytes: int = 4
) -> float:
    """``VocabEmbedding3D`` (padded vocabulary V): 2(q-1)/q^3 (V h + M h)."""
    return 2 * (q - 1) / q**3 * (vocab_size + tokens) * hidden_size * elem_bytes


def position3d_bytes(seq_length: int, hidden_size: int, q: int, *, elem_bytes: int = 4) -> float:
    """``PositionEmbedding3D``: its ``[s, h/q]`` rows' grad all-reduced over two sub-axes,
    4(q-1)/q^2 s h."""
    return 4 * (q - 1) / q**2 * seq_length * hidden_size * elem_bytes


def cross_entropy3d_bytes(
    tokens: int, q: int, *, label_smoothing: bool = False, elem_bytes: int = 4
) -> float:
    """``cross_entropy_3d``: three all-reduces of ``[M/q^2]`` (four with label smoothing) over the
    input group, none in backward: 6(q-1)/q^3 M (8 with label smoothing)."""
    count = 4 if label_smoothing else 3
    return count * 2 * (q - 1) / q**3 * tokens * elem_bytes


def block3d_bytes(
    tokens: int,
    hidden_size: int,
    ffn_hidden_size: int,
    q: int,
    *,
    qkv_size: int | None = None,
    bias: bool = True,
    swiglu: bool = False,
    rms: bool = False,
    elem_bytes: int = 4,
) -> float:
    """A transformer layer: two norms, QKV (h -> qkv_size, default 3h), the attention projection,
    fc1 (h -> ffn, 2 ffn under SwiGLU) and fc2."""
    m, h, f = tokens, hidden_size, ffn_hidden_size
    kw = dict(bias=bias, elem_bytes=elem_bytes)
    return (
        2 * norm3d_bytes(m, h, q, rms=rms, elem_bytes=elem_bytes)
        + linear3d_bytes(m, h, qkv_size or 3 * h, q, **kw)
        + linear3d_bytes(m, h, h, q, **kw)
        + linear3d_bytes(m, h, 2 * f if swiglu else f, q, **kw)
        + linear3d_bytes(m, f, h, q, **kw)
    )
