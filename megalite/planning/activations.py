"""Activation bytes one rank keeps for backward, from the tensors megalite's own modules save.

Each term below is a tensor autograd saves in megalite's forward (checked against saved-tensor
hooks, ``measure.saved_tensors.SavedTensorMeter``, in tests/planning), counted once per storage:
views share their base's storage, and a tensor saved by two ops counts once. Per micro-batch,
with ``T = s b`` tokens, ``Tn = T / tp`` under sequence parallel (else ``T``), ``e`` the
activation dtype's bytes, ``n, g`` heads and query groups per TP rank, ``d`` the head dim,
``f`` the FFN size per TP rank::

    norm (LayerNorm)          x [Tn, h] e  + mean, rstd [Tn] fp32
    norm (RMSNorm)            x in fp32 [Tn, h] 4 + rstd [Tn] 4 + normalised y [Tn, h] e;
                              the fused Triton kernel (a GPU): x [Tn, h] e + rstd [Tn] 4
    linear inputs             norm output [Tn, h] e (sequence parallel: the shard; backward
                              all-gathers it again for the weight grad)
    attention (sdpa)          q, k, v (3 [T, n d] e; RoPE with k = v heads: +2 [T, n d] e for
                              the rotated q, k besides the fused qkv) + logsumexp [n T] fp32 +
                              output [T, n d] e
    attention (unfused)       fp32 scores, exp [b n s s] + probs in e + the context [T, n d] e;
                              the fused softmax kernel: its output [b n s s] e alone
    attention (sdpa, dropout) on CPU the math path: scaled q, k^T, v + 3 [b n s s] e + context
    MLP (GELU)                fc1 output [T, f] e + GELU output [T, f] e
    MLP (SwiGLU)              fc1 output [T, 2f] e + silu(gate) [T, f] e + product [T, f] e
    dropout (p > 0)           a bool mask per dropout: 2 [Tn, h] per layer (+ embedding)

a MoE MLP as ``planning.moe_activations`` counts it, under its stated routing assumption;
and per stage: RoPE's cos and sin ``2 [T, d] e``; on the first stage the token ids; on the last
the final norm, the output layer's input and the cross entropy's fp32 softmax ``[T, V/tp] 4``
(plus int64 targets). Recompute keeps only what its checkpoints save: ``full`` the input of each
checkpointed chunk, ``selective`` drops the attention core's logsumexp (and, unfused, the
``s x s`` scores) and recomputes them in backward; the recomputation's own activations are the
transient ``backward_peak``.

The schedule decides how many micro-batches are in flight (its action list replayed,
``replay_peak``); the peak a stage holds is that many micro-batches' saved bytes plus the
transient of a recomputed chunk in backward.
Under a grid (2d, 2.5d) or cube (3d) tensor-parallel mode a device computes a block of the
micro-batch's sequences with every dim split: its layers and extras are ``mode_activations``'.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core import fusions
from megalite.core.pipeline_parallel.generators import SCHEDULES, layout_of
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern
from megalite.planning.attention_bytes import attention_core_bytes
from megalite.planning.mode_activations import (
    chunk_input_bytes,
    mode_chunk_parts,
    mode_loss_transient,
    norm_saves_its_input,
)
from megalite.planning.model_state import DTYPE_BYTES
from megalite.planning.moe_activations import BALANCED, WORST, MoEShape, Routing, moe_mlp_bytes
from megalite.planning.schedule_replay import replay_peak, schedule_lists
from megalite.planning.tp_split import TPSplit
from megalite.training.model_chunks import stage_blocks

CP_MODELLED = ("p2p", "all_gather")  # --cp-comm-type values whose saved tensors are modelled
# every schedule the pipeline runs: each is predicted by replaying its own action lists
MODELLED_SCHEDULES = SCHEDULES


@dataclass
class StageActivations:
    """Bytes of one micro-batch on one pipeline rank (one TP rank), by part, and the peak."""

    layers: int  # kept for backward by the stage's transformer layers
    per_layer: int  # one layer without recompute
    extras: int  # embedding ids, RoPE tables, final norm, output layer, loss
    backward_peak: int  # the most one micro-batch holds during its backward (recompute)
    in_flight: int  # (micro-batch, chunk) pairs held at the peak (the schedule's)
    replayed: int | None = None  # the peak from the schedule's action list (pipeline ranks)
    loss_transient: int = 0  # freed within the loss's forward (``loss_transient``); last stage
    # MoE layers (planning.moe_activations): the routing ``peak`` assumes, in words, and the peak
    # for any routing the capacity settings allow (None without MoE layers)
    routing: str = ""
    bound: int | None = None

    @property
    def device_peak(self) -> int:
        """The saved-tensor peak plus the loss's transient buffers: what the device must hold."""
        return self.peak + self.loss_transient

    @property
    def per_microbatch(self) -> int:
        return self.layers + self.extras

    @property
    def peak(self) -> int:
        """All in-flight micro-batches kept, or one fewer plus the one in backward."""
        if self.replayed is not None:
            return self.replayed
        held = self.in_flight * self.per_microbatch
        return max(held, held - self.per_microbatch + self.backward_peak)


@dataclass(frozen=True)
class FusedKernels:
    """Which of megalite's fused Triton kernels run in the layers the planner predicts
    (``fused_kernels``): the norms (every LayerNorm and RMSNorm) and the attention softmax (the
    unfused backend's scale-mask-softmax). Each saves other tensors than its PyTorch reference."""

    norms: bool = False
    softmax: bool = False


def fused_kernels(c: GPTConfig, device: str) -> FusedKernels:
    """The kernels that run on ``device`` for a model built from ``c``: none unless the model
    asks for them (``use_fused_kernels``) and they serve there (``fusions.kernels_serve``: a GPU,
    or a CPU under ``TRITON_INTERPRET=1`` with triton importable); then the norms, and the
    softmax where the attention backend computes one (``unfused``)."""
    if not (c.use_fused_kernels and fusions.kernels_serve(device)):
        return FusedKernels()
    return FusedKernels(norms=True, softmax=c.attention_backend == "unfused")


def _norm_bytes(c: GPTConfig, tn: int, e: int, fused: bool = False) -> int:
    """Saved by a norm over [tn, h] (its output, saved by the next linear, is counted there).
    ``fused``: the Triton norm kernel runs; the fused RMSNorm saves its input and rstd alone,
    where the reference path keeps an fp32 copy and the normalised y (LayerNorm: the same)."""
    h = c.hidden_size
    if c.normalization == "LayerNorm":
        return tn * h * e + 2 * tn * 4
    if fused:
        return tn * h * e + tn * 4
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
    cp: int = 1,
    moe: MoEShape | None = None,
    fused: FusedKernels = FusedKernels(),
    routing: Routing = BALANCED,
) -> int:
    """Saved bytes of one transformer layer on one TP rank for ``tokens = s b`` tokens (this CP
    rank's ``s``); ``moe``: the layer's MLP is a mixture of experts, routed as ``routing``
    assumes; ``fused``: the kernels that run."""
    sp = c.sequence_parallel and tp > 1
    tn = tokens // tp if sp else tokens
    h, d = c.hidden_size, c.kv_channels
    n = c.num_attention_heads // tp
    f = c.ffn_hidden_size // tp
    linear_in = tn * h * e  # the norm output (under SP the shard: backward gathers it again)
    total = 2 * (_norm_bytes(c, tn, e, fused.norms) + linear_in)
    rope = c.position_embedding_type == "rope"
    g = c.num_query_groups // tp
    if cp > 1 and c.cp_comm_type in ("p2p", "all_gather"):
        # megalite's own CP attention saves q, k, v (views of the fused qkv unless rotated; the
        # all-gather design keeps the gathered [2, g, cp s, d] key/value instead), its output
        # and logsumexp, whatever the recompute; then the context re-laid out for linear_proj
        unit = tokens * d * e
        if c.cp_comm_type == "p2p":
            total += unit * ((n + 2 * g) + (n + g if rope else 0) + 2 * n)
        else:
            total += unit * ((n if rope else n + 2 * g) + 2 * g * cp + 2 * n)
        total += n * tokens * 4
    else:
        total += attention_core_bytes(
            c,
            tokens=tokens,
            b=b,
            n=n,
            e=e,
            selective=selective,
            mask_bytes=mask_bytes,
            cpu=cpu,
            fused_softmax=fused.softmax,
        )
    if moe is None:
        total += (4 if c.swiglu else 2) * tokens * f * e
    else:
        moe_tokens = tokens // tp if tp > 1 else tokens  # each TP rank routes its 1/tp
        total += moe_mlp_bytes(c, moe, tokens=moe_tokens, e=e, routing=routing)
        if c.moe_shared_expert_intermediate_size is not None:  # a dense MLP beside the experts
            total += (
                (4 if c.swiglu else 2) * tokens * c.moe_shared_expert_intermediate_size // tp * e
            )
            if c.moe_shared_expert_gate:  # its output and the sigmoid gate, for their product
                total += tn * (h + 1) * e
    if c.hidden_dropout > 0:
        total += 2 * tn * h * mask_bytes
    return total


def stage_extras(
    c: GPTConfig,
    *,
    tokens: int,
    tp: int,
    e: int,
    first: bool,
    last: bool,
    mask_bytes: int = 1,
    cp: int = 1,
    fused: FusedKernels = FusedKernels(),
) -> int:
    sp = c.sequence_parallel and tp > 1
    tn = tokens // tp if sp else tokens
    h = c.hidden_size
    out = 0
    if c.position_embedding_type == "rope":
        out += 2 * tokens * c.kv_channels * e
    if first and cp > 1:  # this CP rank's ids and positions (a mask instead under TP)
        out += tokens * 8 + (tokens if tp > 1 else tokens * 8)
        if c.hidden_dropout > 0:
            out += tn * h * mask_bytes
    elif first:
        out += tokens * 8 * (3 if tp > 1 else 1)  # ids (local ids and masks under TP)
        if c.hidden_dropout > 0:
            out += tn * h * mask_bytes
    if last:
        vocab = c.padded_vocab_size(tp) // tp
        out += _norm_bytes(c, tn, e, fused.norms) + tn * h * e  # final norm, output layer input
        out += tokens * vocab * 4 + tokens * (8 + 1) + vocab + tokens * 4 + 4  # loss
    return out


def loss_transient(c: GPTConfig, *, tokens: int, tp: int, e: int) -> int:
    """Bytes the cross entropy's forward holds beside what it saves (its fp32 softmax, counted
    in ``stage_extras``): the output layer's logits ``[T, V/tp] e`` and, below fp32, their fp32
    copy. For a large vocabulary this is the rank's peak: Llama 3's 128k vocabulary at 16k tokens
    a micro-batch holds 11.8 GiB here in bf16."""
    vocab = c.padded_vocab_size(tp) // tp
    return tokens * vocab * (e + (4 if e != 4 else 0))


def _chunk_activations(
    c: GPTConfig,
    *,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    micro_batch_size: int,
    tp: int,
    e: int,
    mask_bytes: int,
    cpu: bool,
    cp: int = 1,
    moe: MoEShape | None = None,
    fused: FusedKernels = FusedKernels(),
    routing: Routing = BALANCED,
    split: TPSplit | None = None,
) -> tuple[int, int, int, int]:
    """(layers, per_layer, extras, backward_peak) of one model chunk for one micro-batch;
    ``split``: a grid or cube tensor-parallel mode (``mode_activations``), else 1d over ``tp``."""
    b, s = micro_batch_size, c.seq_length // cp
    tokens = s * b
    n_layers = layers[1] - layers[0]
    selective = c.recompute_granularity == "selective"
    if split is not None and split.mode != "1d":
        each, extras, early_extras = mode_chunk_parts(
            c,
            split,
            n_layers=n_layers,
            first=first,
            last=last,
            b=b,
            e=e,
            selective=selective,
            mask_bytes=mask_bytes,
            cpu=cpu,
            fused_softmax=fused.softmax,
        )
        chunk_input = chunk_input_bytes(c, split, tokens=tokens, e=e)
        shares_input = norm_saves_its_input(c)
    else:
        pattern = moe_layer_pattern(c)
        common = dict(tokens=tokens, tp=tp, e=e, mask_bytes=mask_bytes, cp=cp, fused=fused)
        each = [
            layer_bytes(
                c,
                **common,
                b=b,
                selective=selective,
                cpu=cpu,
                moe=moe if pattern[i] else None,
                routing=routing,
            )
            for i in range(*layers)
        ]
        extras = stage_extras(c, **common, first=first, last=last)
        # in backward the loss and output layer are freed before any layer is recomputed
        early_extras = stage_extras(c, **common, first=first, last=False)
        sp = c.sequence_parallel and tp > 1
        chunk_input = (tokens // tp if sp else tokens) * c.hidden_size * e
        shares_input = c.normalization == "LayerNorm" or e == 4
    per_layer = max(each, default=0)
    # a recomputed chunk's first norm saves the chunk input itself (no new storage)
    recomputed_extra = per_layer - (chunk_input if shares_input else 0)
    kept_bytes = sum(each)
    backward_peak = 0
    if c.recompute_granularity == "full":
        per = c.recompute_num_layers
        if c.recompute_method == "uniform":
            chunks = -(-n_layers // per)
            kept_bytes = chunks * chunk_input
            last_chunk = n_layers - (chunks - 1) * per
            backward_peak = (
                kept_bytes + early_extras + (last_chunk - 1) * per_layer + recomputed_extra
            )
        else:  # block: the first `per` layers one at a time, the rest keep their activations
            kept = min(per, n_layers)
            kept_bytes = kept * chunk_input + (n_layers - kept) * per_layer
            if kept:
                backward_peak = kept * chunk_input + early_extras + recomputed_extra
    return kept_bytes, per_layer, extras, backward_peak


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
    vp: int = 1,
    microbatch_group_size: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    ep_rank: int = 0,
    routing: Routing = BALANCED,
    tp_mode: str = "1d",
    tp_depth: int = 1,
) -> StageActivations:
    """Activation bytes of pipeline rank ``pp_rank`` (any TP rank; expert-parallel rank
    ``ep_rank``) under ``schedule`` with ``vp`` model chunks per rank (the V schedules: 2): the
    schedule's own action list for this rank is replayed (``replay_peak``), so each schedule's
    in-flight micro-batches and chunks, uneven chunks included, come from the lists the executor
    runs. MoE layers are routed as ``routing`` assumes; ``bound`` is the peak under the worst
    routing their capacity settings allow. ``tp_mode`` / ``tp_depth``: the tensor-parallel mode
    (a grid's or the cube's layers: ``mode_activations``)."""
    split = TPSplit(tp_mode, tp, tp_depth)
    e = DTYPE_BYTES[precision]
    mask_bytes = e if device == "cpu" else 1  # CPU dropout saves its scaled noise, CUDA a bool
    layout = layout_of(schedule, pp, vp)
    blocks = stage_blocks(c, layout)
    etp = etp or tp
    moe = MoEShape(ep=ep, etp=etp, group=ep * etp, ep_rank=ep_rank) if c.num_experts else None
    fused = fused_kernels(c, device)

    def chunk_parts(routing: Routing) -> list[tuple[int, int, int, int]]:
        return [
            _chunk_activations(
                c,
                layers=blocks[s],
                first=s == 0,
                last=s == layout.num_stages - 1,
                micro_batch_size=micro_batch_size,
                tp=tp,
                e=e,
                mask_bytes=mask_bytes,
                cpu=device == "cpu",
                cp=cp,
                moe=moe,
                fused=fused,
                routing=routing,
                split=split,
            )
            for s in (layout.stage(pp_rank, chunk) for chunk in range(layout.num_chunks))
        ]

    last = any(layout.stage(pp_rank, k) == layout.num_stages - 1 for k in range(layout.num_chunks))
    tokens = micro_batch_size * c.seq_length // cp
    if split.mode != "1d":
        transient_loss = mode_loss_transient(c, split, tokens=tokens, e=e) if last else 0
    else:
        transient_loss = loss_transient(c, tokens=tokens, tp=tp, e=e) if last else 0

    def assemble(parts: list[tuple[int, int, int, int]]) -> StageActivations:
        layers = sum(p[0] for p in parts)
        extras = sum(p[2] for p in parts)
        per_layer = parts[0][1]
        held = [p[0] + p[2] for p in parts]
        transient = [p[3] if p[3] else p[0] + p[2] for p in parts]
        if pp == 1 and layout.num_chunks == 1:
            return StageActivations(
                layers, per_layer, extras, parts[0][3], 1, loss_transient=transient_loss
            )
        lists = schedule_lists(schedule, pp, num_microbatches, vp, microbatch_group_size)
        peak, most = replay_peak(lists[pp_rank], held, transient)
        backward_peak = max(p[3] for p in parts)
        return StageActivations(
            layers,
            per_layer,
            extras,
            backward_peak,
            most,
            replayed=peak,
            loss_transient=transient_loss,
        )

    out = assemble(chunk_parts(routing))
    if c.num_experts:
        out.routing = routing.describe(c)
        out.bound = out.peak if routing.worst else assemble(chunk_parts(WORST)).peak
    return out
