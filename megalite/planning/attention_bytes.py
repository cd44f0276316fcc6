"""What the attention core saves for backward on one device, for any split of its heads.

Shared by every tensor-parallel mode's layer (``activations.layer_bytes`` under 1d,
``mode_activations`` under the grids and the cube): the core sees ``tokens = s b`` tokens of
``b`` whole sequences and ``n`` heads of ``g`` query groups on this device; which backend runs,
recompute and dropout decide what it keeps (``activations``' module docstring lists the terms).
"""

from __future__ import annotations

from megalite.models.config import GPTConfig


def attention_core_bytes(
    c: GPTConfig,
    *,
    tokens: int,
    b: int,
    n: int,
    e: int,
    selective: bool,
    mask_bytes: int,
    cpu: bool,
    fused_softmax: bool,
) -> int:
    """Saved bytes of the attention core (no context parallelism) over ``n`` heads on this
    device: q, k, v, what the backend keeps of the scores, the output (and, unfused, the context
    re-laid out for the output projection)."""
    d, k = c.kv_channels, c.heads_per_group
    s = tokens // b
    qkv = tokens * n * d * e
    rope = c.position_embedding_type == "rope"
    scores = b * n * s * s
    if c.block_sparse:
        # windowed / block-sparse attention (core.attention.block_sparse) saves q, k and v (k, v
        # expanded to the heads), its output and logsumexp: O(s), never a score block; under
        # selective recompute only its inputs. Not yet checked against a measured run.
        total = 3 * qkv + (2 * qkv if rope and k == 1 else 0)
        return total + qkv + (0 if selective else qkv + n * tokens * 4)
    if c.attention_backend == "sdpa" and cpu and c.attention_dropout > 0 and not selective:
        # CPU sdpa with dropout runs the math path: scaled q, k^T copy, v (a view of the fused
        # qkv when each group has one head), softmax, noise, dropped probs; the context
        return 2 * qkv + (3 * qkv if k == 1 else qkv) + 3 * scores * e + qkv
    total = 3 * qkv + (2 * qkv if rope and k == 1 else 0)
    if c.attention_backend == "sdpa":
        return total + qkv + (0 if selective else n * tokens * 4)  # output (+ logsumexp)
    dropout = c.attention_dropout > 0
    if not selective and fused_softmax:  # the kernel saves its output alone; dropout its
        total += scores * e * (2 if dropout else 1)  # noise and the dropped probs
        total += scores * mask_bytes if dropout else 0
    elif not selective:  # fp32 masked scores, exp, probs in e; the mask, row statistics
        total += scores * (4 + 4 + e) + s * s + b * n * s * 13
        total += scores * mask_bytes if dropout else 0
    return total + qkv  # the context, re-laid out for the output projection
