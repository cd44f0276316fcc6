"""Model-state bytes of one rank, predicted exactly as ``core.optimizer.memory_report`` measures.

The parameters of a rank are listed in registration order (``param_numels``, mirroring
``GPTModel``), laid into the grad buffer with the same ``GradBufferLayout`` the DP wrapper builds
(buckets, padding), and each ZeRO rung says which storages exist and how they are sharded
(``ZERO_RUNGS``). The result is a ``memory_report.ModelStateBytes`` so predicted and measured
figures compare field by field.

A rung is a row of ``ZERO_RUNGS``: which of params, grads and fp32 master + Adam states are
sharded over DP. Bytes per parameter for bf16 params, fp32 grads and masters (``4 + 12/N`` for
ZeRO-1, Megatron's ``optim``) follow from the row; the ZeRO-2/3 rows (``optim_grads``,
``optim_grads_params``) and CPU offload (``offload_fraction``: the share of master + Adam state
held in host memory) plug in here when issue 13 lands.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.distributed.grad_buffer import GradBufferLayout
from megalite.core.optimizer.memory_report import ModelStateBytes
from megalite.models.config import GPTConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ZeroRung:
    """What a data-parallel sharding rung shards over DP (Megatron's names)."""

    name: str
    shard_params: bool
    shard_grads: bool
    shard_optimizer: bool  # fp32 master + Adam moments
    available: bool  # implemented in megalite today (else the planner refuses it)
    flags: tuple[str, ...]  # pretrain_gpt.py flags that select it


ZERO_RUNGS: dict[str, ZeroRung] = {
    "no_shard": ZeroRung("no_shard", False, False, False, True, ()),
    "optim": ZeroRung("optim", False, False, True, True, ("--use-distributed-optimizer",)),
    # issue 13: flip `available` and give the flags when ZeRO-2/3 land
    "optim_grads": ZeroRung("optim_grads", False, True, True, False, ("--zero-stage", "2")),
    "optim_grads_params": ZeroRung(
        "optim_grads_params", True, True, True, False, ("--zero-stage", "3")
    ),
}


def bytes_per_param(rung: str, dp: int, *, param_bytes: int = 2, grad_bytes: int = 4) -> float:
    """The textbook figure (no padding): params + grads + master + Adam moments per parameter,
    e.g. ``optim`` with bf16 params and fp32 grads: ``2 + 4 + 12/dp``."""
    r = ZERO_RUNGS[rung]
    master = 4 if param_bytes != 4 else 0
    return (
        param_bytes / (dp if r.shard_params else 1)
        + grad_bytes / (dp if r.shard_grads else 1)
        + (master + 8) / (dp if r.shard_optimizer else 1)
    )


def param_numels(cfg: GPTConfig, *, tp: int, pp: int, pp_rank: int) -> list[tuple[str, int]]:
    """(name, elements) of every trainable parameter of pipeline rank ``pp_rank`` on one TP rank,
    in ``GPTModel``'s registration order."""
    h, t = cfg.hidden_size, tp
    vocab = cfg.padded_vocab_size(tp) // t
    first, last = pp_rank == 0, pp_rank == pp - 1
    bias = cfg.add_bias_linear
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    out: list[tuple[str, int]] = []
    if first:
        out.append(("embedding.word_embeddings.weight", vocab * h))
        if cfg.position_embedding_type == "learned_absolute":
            out.append(("embedding.position_embeddings.weight", cfg.max_position_embeddings * h))
    start, end = cfg.stage_layer_ranges(pp)[pp_rank]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels // t
    proj_in = cfg.num_attention_heads * cfg.kv_channels // t
    fc1 = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size // t
    fc2_in = cfg.ffn_hidden_size // t
    for i in range(start, end):
        p = f"decoder.layers.{i}."
        out.append((p + "input_layernorm", norm))
        out.append((p + "self_attention.linear_qkv.weight", qkv * h))
        if bias:
            out.append((p + "self_attention.linear_qkv.bias", qkv))
        out.append((p + "self_attention.linear_proj.weight", h * proj_in))
        if bias:
            out.append((p + "self_attention.linear_proj.bias", h))
        out.append((p + "pre_mlp_layernorm", norm))
        out.append((p + "mlp.linear_fc1.weight", fc1 * h))
        if bias:
            out.append((p + "mlp.linear_fc1.bias", fc1))
        out.append((p + "mlp.linear_fc2.weight", h * fc2_in))
        if bias:
            out.append((p + "mlp.linear_fc2.bias", h))
    if last:
        out.append(("decoder.final_layernorm", norm))
        tied = not cfg.untie_embeddings_and_output_weights
        if not (tied and first):  # tied on one stage: the output layer borrows the embedding
            out.append(("output_layer.weight", vocab * h))
    return _split_norms(out, cfg)


def _split_norms(params: list[tuple[str, int]], cfg: GPTConfig) -> list[tuple[str, int]]:
    """A norm is registered as weight (then bias for LayerNorm)."""
    out = []
    for name, n in params:
        if name.endswith("layernorm"):
            h = cfg.hidden_size
            out.append((name + ".weight", h))
            if cfg.normalization == "LayerNorm":
                out.append((name + ".bias", h))
        else:
            out.append((name, n))
    return out


def model_state_bytes(
    cfg: GPTConfig,
    *,
    tp: int,
    pp: int,
    dp: int,
    pp_rank: int,
    dp_rank: int = 0,
    rung: str = "no_shard",
    precision: str = "fp32",
    bucket_size: int | None,
    grads_in_fp32: bool = False,
) -> ModelStateBytes:
    """The bytes ``memory_report.model_state_bytes`` measures on the rank (``pp_rank``,
    ``dp_rank``), before or after the first step (Adam moments and one 4-byte step counter per
    optimized tensor). ``bucket_size``: elements per grad bucket
    (``ParallelConfig.bucket_size``)."""
    r = ZERO_RUNGS[rung]
    if not r.available:
        raise NotImplementedError(f"ZeRO rung {rung} is not implemented yet (issue 13)")
    numels = [n for _, n in param_numels(cfg, tp=tp, pp=pp, pp_rank=pp_rank)]
    p_bytes = DTYPE_BYTES[precision]
    g_bytes = 4 if grads_in_fp32 else p_bytes
    master_bytes = 0 if p_bytes == 4 else 4
    pad = dp if r.shard_optimizer or r.shard_grads else 1
    layout = GradBufferLayout(numels, bucket_size=bucket_size, pad_multiple=pad)
    total = sum(numels)
    if r.shard_optimizer:
        # params live in a param buffer of the grad buffer's (padded) layout
        params = layout.numel * p_bytes
        shard = layout.numel // dp
        pieces = _pieces(layout, dp, dp_rank)
        master = shard * master_bytes
        optimizer = 2 * shard * 4 + 4 * pieces
    else:
        params = total * p_bytes
        master = total * master_bytes
        optimizer = sum(2 * n * 4 + 4 for n in numels)
    grads = layout.numel * g_bytes
    theory = total * (p_bytes + g_bytes) + total * (master_bytes + 8) / (
        dp if r.shard_optimizer else 1
    )
    return ModelStateBytes(
        params=params,
        grads=grads,
        master=master,
        optimizer=optimizer,
        theory=round(theory),
        num_params=total,
        stage=list(ZERO_RUNGS).index(r.name),  # the ZeRO stage, as memory_report records it
    )


def _pieces(layout: GradBufferLayout, dp: int, dp_rank: int) -> int:
    """Parameters (or parts of one) in the rank's shard: one Adam step counter each."""
    segments = layout.shard_segments(dp, dp_rank)
    count = 0
    for p_lo, p_hi, k in layout.param_ranges:
        s_lo, s_hi, _ = segments[k]
        if max(p_lo, s_lo) < min(p_hi, s_hi):
            count += 1
    return count
