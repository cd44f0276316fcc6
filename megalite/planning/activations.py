"""Activation bytes one rank keeps for backward, from the tensors megalite's own modules save.

Each term below is a tensor autograd saves in megalite's forward (checked against saved-tensor
hooks, ``planning.measure.SavedTensorMeter``, in tests/planning), counted once per storage:
views share their base's storage, and a tensor saved by two ops counts once. Per micro-batch,
with ``T = s b`` tokens, ``Tn = T / tp`` under sequence parallel (else ``T``), ``e`` the
activation dtype's bytes, ``n, g`` heads and query groups per TP rank, ``d`` the head dim,
``f`` the FFN size per TP rank::

    norm (LayerNorm)          x [Tn, h] e  + mean, rstd [Tn] fp32
    norm (RMSNorm)            x in fp32 [Tn, h] 4 + rstd [Tn] 4 + normalised y [Tn, h] e
    linear inputs             norm output [Tn, h] e (sequence parallel: gathered [T, h] e)
    attention (sdpa)          q, k, v (3 [T, n d] e; RoPE with k = v heads: +2 [T, n d] e for
                              the rotated q, k besides the fused qkv) + logsumexp [n T] fp32 +
                              output [T, n d] e
    attention (unfused)       fp32 scores, exp [b n s s] + probs in e + the context [T, n d] e
    attention (sdpa, dropout) on CPU the math path: scaled q, k^T, v + 3 [b n s s] e + context
    MLP (GELU)                fc1 output [T, f] e + GELU output [T, f] e
    MLP (SwiGLU)              fc1 output [T, 2f] e + silu(gate) [T, f] e + product [T, f] e
    dropout (p > 0)           a bool mask per dropout: 2 [Tn, h] per layer (+ embedding)

and per stage: RoPE's cos and sin ``2 [T, d] e``; on the first stage the token ids; on the last
the final norm, the output layer's input and the cross entropy's fp32 softmax ``[T, V/tp] 4``
(plus int64 targets). Recompute keeps only what its checkpoints save: ``full`` the input of each
checkpointed chunk, ``selective`` drops the attention core's logsumexp (and, unfused, the
``s x s`` scores) and recomputes them in backward; the recomputation's own activations are the
transient ``backward_peak``.

The schedule decides how many micro-batches are in flight (``IN_FLIGHT``); the peak a stage holds
is that many micro-batches' saved bytes plus the transient of a recomputed chunk in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megalite.models.config import GPTConfig


def _in_flight_1f1b(pp_rank: int, pp: int, m: int, v: int = 1) -> int:
    # warmup of pp - pp_rank - 1 forwards, then one more before the first backward
    return min(pp - pp_rank, m)


def _in_flight_gpipe(pp_rank: int, pp: int, m: int, v: int = 1) -> int:
    return m  # every forward before any backward


# Micro-batches (x model chunks) whose activations a pipeline rank holds at its peak, per schedule:
# (pp_rank, pp_size, num_microbatches, virtual stages) -> count of (micro-batch, chunk) pairs.
# issue 14 adds interleaved, zb-h1, zbv and dualpipev here (or derives them from the action lists).
IN_FLIGHT: dict[str, Callable[[int, int, int, int], int]] = {
    "1f1b": _in_flight_1f1b,
    "gpipe": _in_flight_gpipe,
}


@dataclass
class StageActivations:
    """Bytes of one micro-batch on one pipeline rank (one TP rank), by part, and the peak."""

    layers: int  # kept for backward by the stage's transformer layers
    per_layer: int  # one layer without recompute
    extras: int  # embedding ids, RoPE tables, final norm, output layer, loss
    backward_peak: int  # the most one micro-batch holds during its backward (recompute)
    in_flight: int  # micro-batches held at the peak (the schedule's)

    @property
    def per_microbatch(self) -> int:
        return self.layers + self.extras

    @property
    def peak(self) -> int:
        """All in-flight micro-batches kept, or one fewer plus the one in backward."""
        held = self.in_flight * self.per_microbatch
        return max(held, held - self.per_microbatch + self.backward_peak)


def _norm_bytes(c: GPTConfig, tn: int, e: int) -> int:
    """Saved by a norm over [tn, h] (its output, saved by the next linear, is counted there)."""
    h = c.hidden_size
    if c.normalization == "LayerNorm":
        return tn * h * e + 2 * tn * 4
    return tn * h * 4 + tn * 4 + tn * h * e


def layer_bytes(
    c: GPTConfig,
    *,
    tokens: int,
    b: int,
    tp: int,
    e: int,
    selective: bool,
    mask_bytes: int,
    cpu: bool = False,
) -> int:
    """Saved bytes of one transformer layer on one TP rank for ``tokens = s b`` tokens."""
    sp = c.sequence_parallel and tp > 1
    tn = tokens // tp if sp else tokens
    h, d = c.hidden_size, c.kv_channels
    n = c.num_attention_heads // tp
    f = c.ffn_hidden_size // tp
    k = c.heads_per_group
    s = tokens // b
    linear_in = (tokens if sp else tn) * h * e  # the norm output, gathered under SP
    total = 2 * (_norm_bytes(c, tn, e) + linear_in)
    qkv = tokens * n * d * e
    rope = c.position_embedding_type == "rope"
    scores = b * n * s * s
    if c.attention_backend == "sdpa" and cpu and c.attention_dropout > 0 and not selective:
        # CPU sdpa with dropout runs the math path: scaled q, k^T copy, v (a view of the fused
        # qkv when each group has one head), softmax, noise, dropped probs; the context
        total += 2 * qkv + (3 * qkv if k == 1 else qkv) + 3 * scores * e + qkv
    elif c.attention_backend == "sdpa":
        total += 3 * qkv + (2 * qkv if rope and k == 1 else 0)
        total += qkv + (0 if selective else n * tokens * 4)  # output (+ logsumexp)
    else:
        total += 3 * qkv + (2 * qkv if rope and k == 1 else 0)
        if not selective:  # fp32 masked scores, exp, probs in e; the mask, row statistics
            total += scores * (4 + 4 + e) + s * s + b * n * s * 13
            total += scores * mask_bytes if c.attention_dropout > 0 else 0
        total += qkv  # the context, re-laid out for the output projection
    total += (4 if c.swiglu else 2) * tokens * f * e
    if c.hidden_dropout > 0:
        total += 2 * tn * h * mask_bytes
    return total


def stage_extras(
    c: GPTConfig, *, tokens: int, tp: int, e: int, first: bool, last: bool, mask_bytes: int = 1
) -> int:
    sp = c.sequence_parallel and tp > 1
    tn = tokens // tp if sp else tokens
    h = c.hidden_size
    out = 0
    if c.position_embedding_type == "rope":
        out += 2 * tokens * c.kv_channels * e
    if first:
        out += tokens * 8 * (3 if tp > 1 else 1)  # ids (local ids and masks under TP)
        if c.hidden_dropout > 0:
            out += tn * h * mask_bytes
    if last:
        vocab = c.padded_vocab_size(tp) // tp
        out += _norm_bytes(c, tn, e) + tokens * h * e  # final norm, output layer input
        out += tokens * vocab * 4 + tokens * (8 + 1) + vocab + tokens * 4 + 4  # loss
    return out


def stage_activations(
    c: GPTConfig,
    *,
    micro_batch_size: int,
    tp: int,
    pp: int,
    pp_rank: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    precision: str = "fp32",
    device: str = "cuda",
) -> StageActivations:
    """Activation bytes of pipeline rank ``pp_rank`` (any TP rank) under ``schedule``."""
    from megalite.planning.model_state import DTYPE_BYTES

    e = DTYPE_BYTES[precision]
    mask_bytes = e if device == "cpu" else 1  # CPU dropout saves its scaled noise, CUDA a bool
    b, s = micro_batch_size, c.seq_length
    tokens = s * b
    start, end = c.stage_layer_ranges(pp)[pp_rank]
    n_layers = end - start
    selective = c.recompute_granularity == "selective"
    per_layer = layer_bytes(
        c,
        tokens=tokens,
        b=b,
        tp=tp,
        e=e,
        selective=selective,
        mask_bytes=mask_bytes,
        cpu=device == "cpu",
    )
    first, last = pp_rank == 0, pp_rank == pp - 1
    common = dict(tokens=tokens, tp=tp, e=e, mask_bytes=mask_bytes)
    extras = stage_extras(c, **common, first=first, last=last)
    # in backward the loss and output layer are freed before any layer is recomputed
    early_extras = stage_extras(c, **common, first=first, last=False)
    sp = c.sequence_parallel and tp > 1
    chunk_input = (tokens // tp if sp else tokens) * c.hidden_size * e
    # a recomputed chunk's first norm saves the chunk input itself (no new storage)
    recomputed_extra = per_layer - (chunk_input if c.normalization == "LayerNorm" or e == 4 else 0)
    layers = n_layers * per_layer
    backward_peak = 0
    if c.recompute_granularity == "full":
        per = c.recompute_num_layers
        if c.recompute_method == "uniform":
            chunks = -(-n_layers // per)
            layers = chunks * chunk_input
            last_chunk = n_layers - (chunks - 1) * per
            backward_peak = layers + early_extras + (last_chunk - 1) * per_layer + recomputed_extra
        else:  # block: the first `per` layers one at a time, the rest keep their activations
            kept = min(per, n_layers)
            layers = kept * chunk_input + (n_layers - kept) * per_layer
            if kept:
                backward_peak = kept * chunk_input + early_extras + recomputed_extra
    in_flight = IN_FLIGHT[schedule](pp_rank, pp, num_microbatches, 1) if pp > 1 else 1
    return StageActivations(layers, per_layer, extras, backward_peak, in_flight)
