"""Activation bytes one device keeps for backward under the grid (2d, 2.5d) and cube (3d)
tensor-parallel modes, from the tensors their layers save (``tensor_parallel/modes``), checked
against saved-tensor hooks in tests/planning/test_tp_mode_memory.py.

With ``T`` the micro-batch's tokens (``s b``), a device computes a block of whole sequences:
``Tb = T / (d q)`` tokens on a ``d x q x q`` grid (2d: d = 1), ``Tc = T / q^2`` in the cube; its
hidden states are ``[.., h/q]``, its heads ``n/q``, its ffn ``f/q``, its vocabulary ``V/q``
(``tp_split.TPSplit``). Per layer:

    grid   each norm: its input (LayerNorm: centred), the normalised x, the scaled output the
           next linear saves (every linear saves its input block alone): 3 [Tb, h/q] e + [Tb] e;
           the attention core on its Tb tokens and n/q heads (``attention_bytes``; the output
           projection's input is a view of the core's output); the MLP as 1d's on f/q
    cube   each norm: 2 [Tc, h/q] e + [Tc] e; every linear saves its input gathered over q
           (``Linear3D``): q [Tc, in/q] e for qkv and fc1 (in = h), proj (n d) and fc2 (f);
           the attention core on Tc tokens and n/q heads; the MLP's fc1 output (SwiGLU: and the
           gate's silu), its fc2 input being the gathered copy

Per stage as 1d's (``activations.stage_extras``) on the device's blocks: RoPE's tables, the token
ids (gathered over a grid column: ``q Tb`` ids and their mask; in the cube the ids' rows ``T/q``),
the final norm and the output layer's input, the cross entropy's fp32 softmax ``[Tb, V/q]`` (cube:
``[Tc, V/q]``), targets and vocabulary mask, and the loss of the whole micro-batch (gathered).
"""

from __future__ import annotations

from megalite.models.config import GPTConfig
from megalite.planning.attention_bytes import attention_core_bytes
from megalite.planning.tp_split import TPSplit


def block_tokens(split: TPSplit, tokens: int) -> int:
    """The tokens of a micro-batch of ``tokens`` one device computes (``Tb`` / ``Tc``)."""
    return tokens // split.batch_blocks


def chunk_input_bytes(c: GPTConfig, split: TPSplit, *, tokens: int, e: int) -> int:
    """The hidden states entering a chunk on one device: ``[T_block, h/q]``."""
    return block_tokens(split, tokens) * (c.hidden_size // split.q) * e


def norm_saves_its_input(c: GPTConfig) -> bool:
    """Whether a mode's first norm saves its input itself (RMSNorm's ``x * x``; LayerNorm saves
    the centred copy): then a recomputed chunk's checkpointed input is no new storage."""
    return c.normalization == "RMSNorm"


def mode_layer_bytes(
    c: GPTConfig,
    split: TPSplit,
    *,
    tokens: int,
    b: int,
    e: int,
    selective: bool,
    mask_bytes: int,
    cpu: bool,
    fused_softmax: bool,
) -> int:
    """Saved bytes of one transformer layer on one device (module docstring) for a micro-batch
    of ``b`` sequences, ``tokens = s b``."""
    q, cube = split.q, split.mode == "3d"
    t = block_tokens(split, tokens)
    h, f = c.hidden_size // q, c.ffn_hidden_size // q
    norm = (2 if cube else 3) * t * h * e + t * e
    total = 2 * norm
    total += attention_core_bytes(
        c,
        tokens=t,
        b=b // split.batch_blocks,
        n=c.num_attention_heads // q,
        e=e,
        selective=selective,
        mask_bytes=mask_bytes,
        cpu=cpu,
        fused_softmax=fused_softmax,
    )
    if cube:  # the gathered inputs of qkv, fc1 (h/q), proj (n d / q) and fc2 (f/q)
        proj_in = c.num_attention_heads * c.kv_channels // q
        total += q * t * (2 * h + proj_in + f) * e
        total += (3 if c.swiglu else 1) * t * f * e
    else:
        total += (4 if c.swiglu else 2) * t * f * e
    if c.hidden_dropout > 0:
        total += 2 * t * h * mask_bytes
    return total


def mode_stage_extras(
    c: GPTConfig,
    split: TPSplit,
    *,
    tokens: int,
    e: int,
    first: bool,
    last: bool,
    mask_bytes: int = 1,
) -> int:
    """What a stage saves outside its layers on one device (module docstring)."""
    q, cube = split.q, split.mode == "3d"
    t = block_tokens(split, tokens)
    h = c.hidden_size // q
    out = 0
    if c.position_embedding_type == "rope":
        out += 2 * t * c.kv_channels * e
    if first:
        ids = tokens // q if cube else q * t  # the rows the embedding looks up
        out += ids * (8 + 1)  # int64 ids and the in-vocabulary mask
        if c.position_embedding_type == "learned_absolute":
            out += t * 8
        if c.hidden_dropout > 0:
            out += t * h * mask_bytes
    if last:
        vocab = split.vocab(c)
        out += (2 if cube else 3) * t * h * e + t * e  # the final norm (and its output)
        out += q * t * h * e if cube else 0  # the output layer's gathered input
        out += t * vocab * 4 + t * (8 + 1) + vocab + tokens * 4 + 4  # loss
    return out


def mode_loss_transient(c: GPTConfig, split: TPSplit, *, tokens: int, e: int) -> int:
    """The logits ``[T_block, V/q]`` (and, below fp32, their fp32 copy) the cross entropy's
    forward holds beside what it saves."""
    return block_tokens(split, tokens) * split.vocab(c) * (e + (4 if e != 4 else 0))


def mode_chunk_parts(
    c: GPTConfig,
    split: TPSplit,
    *,
    n_layers: int,
    first: bool,
    last: bool,
    b: int,
    e: int,
    selective: bool,
    mask_bytes: int,
    cpu: bool,
    fused_softmax: bool,
) -> tuple[list[int], int, int]:
    """(each layer's bytes, the stage's extras, its extras without the loss) of a chunk of
    ``n_layers`` for one micro-batch of ``b`` sequences."""
    tokens = c.seq_length * b
    layer = mode_layer_bytes(
        c,
        split,
        tokens=tokens,
        b=b,
        e=e,
        selective=selective,
        mask_bytes=mask_bytes,
        cpu=cpu,
        fused_softmax=fused_softmax,
    )
    common = dict(tokens=tokens, e=e, first=first, mask_bytes=mask_bytes)
    extras = mode_stage_extras(c, split, **common, last=last)
    return [layer] * n_layers, extras, mode_stage_extras(c, split, **common, last=False)
