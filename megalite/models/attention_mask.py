"""The attention-mask fields of ``GPTConfig``: which layers are windowed or block-sparse, the
core ``MaskSpec`` of a layer, and their checks (``GPTConfig.validate`` calls ``check_mask``).

``window_size`` (left, right) is Megatron's ``--window-size``; ``window_attn_skip_freq`` is
Megatron's: an integer N makes every N-th layer (1-based: layers N, 2N, ...) full attention and
the others windowed; a list (or its text, ``"[1,1,1,0]*3"``) gives each layer 1 = windowed or 0 =
full. ``sparse_attention`` (fixed, bigbird, longformer) applies to every layer, ANDed with the
window where a layer has one.
"""

from __future__ import annotations

import ast
import functools

import torch

from megalite.core.attention.masks import BlockPlan, MaskSpec, build_block_plan
from megalite.core.attention.sparse_layouts import SPARSE_LAYOUTS, build_layout
from megalite.models.moe_config import _eval_pattern


def window_layer_pattern(config) -> list[bool]:
    """One flag per global layer (0-based): windowed or not."""
    n, freq = config.num_layers, config.window_attn_skip_freq
    if config.window_size is None:
        return [False] * n
    if freq is None:
        return [True] * n
    if isinstance(freq, str):
        try:
            freq = _eval_pattern(ast.parse(freq.strip(), mode="eval"))
        except (SyntaxError, ValueError):
            raise ValueError(
                f"window_attn_skip_freq {config.window_attn_skip_freq!r} is neither an integer "
                "nor a list like [1,1,1,0] or ([1]*3+[0])"
            ) from None
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"window_attn_skip_freq must be >= 1, got {freq}")
        return [(i + 1) % freq != 0 for i in range(n)]
    if len(freq) != n or any(v not in (0, 1) for v in freq):
        raise ValueError(
            f"window_attn_skip_freq has {len(freq)} entries, need num_layers {n} entries of 0 or 1"
        )
    return [bool(v) for v in freq]


def _layout(config):
    if config.sparse_attention is None:
        return None
    return build_layout(
        config.sparse_attention,
        num_local_blocks=config.sparse_num_local_blocks,
        num_global_blocks=config.sparse_num_global_blocks,
        num_window_blocks=config.sparse_num_window_blocks,
        num_random_blocks=config.sparse_num_random_blocks,
        global_blocks=tuple(range(config.sparse_num_global_blocks)),
        seed=config.seed,
    )


def layer_mask_spec(config, layer_number: int) -> MaskSpec | None:
    """The block mask of global layer ``layer_number`` (0-based); None: plain causal attention."""
    window = config.window_size if window_layer_pattern(config)[layer_number] else None
    if window is None and config.sparse_attention is None:
        return None
    layout = _layout(config)
    return MaskSpec(
        causal=True,
        window=tuple(window) if window is not None else None,
        layout=layout,
        layout_block=config.sparse_block_size if layout is not None else 0,
    )


def check_mask(config) -> None:
    """One-line ValueErrors for the window and sparse-attention fields."""
    w = config.window_size
    if w is not None:
        if len(w) != 2 or any(not isinstance(x, int) or x < -1 for x in w):
            raise ValueError(f"window_size must be two integers LEFT,RIGHT >= -1, got {w}")
        if w[0] == 0 and w[1] == 0:
            raise ValueError("window_size 0,0 lets a token see only itself; use LEFT >= 1")
    if config.window_attn_skip_freq is not None and w is None:
        raise ValueError("window_attn_skip_freq needs window_size")
    window_layer_pattern(config)
    s = config.sparse_attention
    if s is not None and s not in SPARSE_LAYOUTS:
        raise ValueError(f"sparse_attention must be one of {', '.join(SPARSE_LAYOUTS)}; got {s!r}")
    for name in ("sparse_block_size", "attention_block_size"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    _layout(config)  # the layout's own checks
    if (w is not None or s is not None) and config.attention_dropout > 0:
        raise ValueError(
            f"window_size / sparse_attention compute only the kept blocks and have no attention "
            f"dropout; set attention_dropout 0 (got {config.attention_dropout})"
        )


def document_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Document ids # [b, s] from a Megatron mask # [b, 1, s, s] (True = hidden, causal
    included): a token's id is the position of the first key it may read, its document's start."""
    return (~attention_mask[:, 0]).int().argmax(-1)


def block_plans(
    spec: MaskSpec,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    block_size: int,
    docs: torch.Tensor | None = None,
) -> list[BlockPlan]:
    """The plans of queries at ``q_pos`` against keys at ``k_pos`` (positions in the sequence):
    one for every sample, or one per sample when ``docs`` # [b, s] (document ids of the whole
    sequence) split them."""
    if docs is None:
        return [build_block_plan(spec, q_pos, k_pos, block_size=block_size)]
    return [
        build_block_plan(spec, q_pos, k_pos, block_size=block_size, q_doc=d[q_pos], k_doc=d[k_pos])
        for d in docs
    ]


@functools.lru_cache(maxsize=64)
def _layer_fraction(spec: MaskSpec, s: int, block_size: int) -> float:
    plan = build_block_plan(spec, torch.arange(s), torch.arange(s), block_size=block_size)
    valid = torch.full((plan.blocks.shape[0],), block_size)
    valid[-1] = s - block_size * (valid.shape[0] - 1)  # the last block may be short
    entries = (plan.blocks * valid[:, None] * valid[None, :]).sum()
    return float(entries) / (s * s)


def attention_fraction(config) -> float:
    """The share of the ``s x s`` score entries the attention computes, averaged over layers:
    a windowed or sparse layer counts the entries of its computed blocks (documents, which depend
    on the data, are not counted), a plain layer the full ``s x s`` (the FLOPs convention)."""
    total = 0.0
    for layer in range(config.num_layers):
        spec = layer_mask_spec(config, layer)
        if spec is None:
            total += 1.0
        else:
            total += _layer_fraction(spec, config.seq_length, config.attention_block_size)
    return total / config.num_layers
