"""Model-state bytes of one rank, predicted exactly as ``core.optimizer.memory_report`` measures.

The parameters of a rank are listed in registration order (``param_numels``, mirroring
``GPTModel``), laid into the grad buffer with the same ``GradBufferLayout`` the DP wrapper builds
(buckets, padding), and each ZeRO rung says which storages exist and how they are sharded
(``ZERO_RUNGS``). The result is a ``memory_report.ModelStateBytes`` so predicted and measured
figures compare field by field.

A rung is a row of ``ZERO_RUNGS``: which of params, grads and fp32 master + Adam states are
sharded over DP. Bytes per parameter follow from the row: with bf16 params, fp32 masters and
fp32 grads (Megatron's default under bf16), ``18`` for DDP, ``6 + 12/N`` for ZeRO-1 (Megatron's
``optim``), ``2 + 16/N`` for ZeRO-2 (``optim_grads``), ``18/N`` for ZeRO-3
(``optim_grads_params``); with bf16 grads (``--grad-reduce-in-bf16``) 16, ``4 + 12/N``,
``2 + 14/N`` and ``16/N``; CPU offload
(``offload_fraction``) moves that share of the sharded master + Adam state to host memory, or
(``optimizer_place="disk"``) to files streamed through the NVMe store's four host buffers.
ZeRO-3's parameter offload (``param_place``) moves the param shards to the host, or to files with
two staging buffers on the host (fp32 params in files are the master file: not counted twice), and
with the whole optimizer state offloaded the grad shards live on the host (``grads_host``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megalite.core.distributed.grad_buffer import GradBufferLayout
from megalite.core.optimizer.memory_report import ModelStateBytes
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern
from megalite.planning.tp_split import TPSplit
from megalite.training.model_chunks import stage_blocks

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
    "optim_grads": ZeroRung("optim_grads", False, True, True, True, ("--zero-stage", "2")),
    "optim_grads_params": ZeroRung(
        "optim_grads_params", True, True, True, True, ("--zero-stage", "3")
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


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter of a rank: its elements, whether it is an expert's (its own grad
    buffer, sharded over the expert DP group) and its ZeRO-3 gather unit (rank-local index)."""

    name: str
    numel: int
    expert: bool = False
    unit: int = 0


def _chunk_params(
    cfg: GPTConfig,
    *,
    split: TPSplit,
    etp: int,
    ep: int,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    borrow: bool,
) -> list[tuple[str, int, bool, str]]:
    """(name, elements, expert, unit name) of one GPT chunk in registration order, as ``split``'s
    mode holds them on one device of the tensor group."""
    h = cfg.hidden_size
    bias = cfg.add_bias_linear
    out: list[tuple[str, int, bool, str]] = []

    def norm(name: str, unit: str) -> None:
        out.append((name + ".weight", split.norm(h), False, unit))
        if cfg.normalization == "LayerNorm":
            out.append((name + ".bias", split.norm(h), False, unit))

    def linear(name: str, out_size: int, in_size: int, unit: str, *, column: bool, b: bool):
        weight, bias_numel = split.linear(out_size, in_size, column=column)
        out.append((name + ".weight", weight, False, unit))
        if b:
            out.append((name + ".bias", bias_numel, False, unit))

    def mlp(p: str, ffn: int, unit: str) -> None:
        fc1 = (2 if cfg.swiglu else 1) * ffn
        linear(p + "linear_fc1", fc1, h, unit, column=True, b=bias)
        linear(p + "linear_fc2", h, ffn, unit, column=False, b=bias)

    if first:
        out.append(("embedding.word_embeddings.weight", split.table(cfg), False, "embedding"))
        if cfg.position_embedding_type == "learned_absolute":
            pos = split.positions(cfg)
            out.append(("embedding.position_embeddings.weight", pos, False, "embedding"))
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    proj_in = cfg.num_attention_heads * cfg.kv_channels
    moe = moe_layer_pattern(cfg)
    for i in range(*layers):
        p, u = f"decoder.layers.{i}.", f"layer{i}"
        norm(p + "input_layernorm", u)
        qkv_bias = bias or cfg.add_qkv_bias
        linear(p + "self_attention.linear_qkv", qkv, h, u, column=True, b=qkv_bias)
        linear(p + "self_attention.linear_proj", h, proj_in, u, column=False, b=bias)
        norm(p + "pre_mlp_layernorm", u)
        if not moe[i]:
            mlp(p + "mlp.", cfg.ffn_hidden_size, u)
            continue
        e, f = cfg.num_experts, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        local = e // ep
        f1 = (2 if cfg.swiglu else 1) * f
        out.append((p + "mlp.router.weight", e * h, False, u))
        out.append((p + "mlp.experts.weight1", local * (f1 // etp) * h, True, u))
        out.append((p + "mlp.experts.weight2", local * h * (f // etp), True, u))
        if cfg.moe_shared_expert_intermediate_size is not None:
            mlp(p + "mlp.shared_experts.", cfg.moe_shared_expert_intermediate_size, u)
            if cfg.moe_shared_expert_gate:
                out.append((p + "mlp.shared_experts_gate.weight", h, False, u))
    if last:
        norm("decoder.final_layernorm", "final_layernorm")
        tied = not cfg.untie_embeddings_and_output_weights
        if not (tied and borrow):  # tied on one rank: the output layer borrows the embedding
            out.append(("output_layer.weight", split.table(cfg), False, "output_layer"))
    return out


@dataclass(frozen=True, eq=False)
class _ConfigKey:
    """A model config hashed and compared by its repr (every field's value), so that equal
    configs from separate parses share one cache entry."""

    cfg: GPTConfig
    text: str

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ConfigKey) and self.text == other.text


def rank_params(
    cfg: GPTConfig,
    *,
    tp: int,
    pp: int,
    pp_rank: int,
    schedule: str = "1f1b",
    vp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    tp_mode: str = "1d",
    tp_depth: int = 1,
) -> list[ParamSpec]:
    """Every trainable parameter of pipeline rank ``pp_rank`` on one TP rank, in registration
    order: the rank's chunks in chunk order (``training.model_chunks``), each ``GPTModel``'s
    order inside, split as the tensor-parallel mode ``tp_mode`` (``tp_split.TPSplit``) splits
    them. ZeRO-3 units: one per embedding / layer / final norm / output layer of a single chunk;
    a whole chunk when the rank holds several (``Zero3DataParallel``'s default units)."""
    key = _ConfigKey(cfg, repr(cfg))
    return list(_rank_params(key, tp, pp, pp_rank, schedule, vp, ep, etp, tp_mode, tp_depth))


@functools.lru_cache(maxsize=1024)
def _rank_params(
    config: _ConfigKey,
    tp: int,
    pp: int,
    pp_rank: int,
    schedule: str,
    vp: int,
    ep: int,
    etp: int | None,
    tp_mode: str,
    tp_depth: int,
) -> tuple[ParamSpec, ...]:
    """``rank_params``, cached by the config's value (the search asks for the same split of one
    model thousands of times)."""
    cfg = config.cfg
    split = TPSplit(tp_mode, tp, tp_depth)
    layout = layout_of(schedule, pp, vp)
    blocks = stage_blocks(cfg, layout)
    stages = [layout.stage(pp_rank, c) for c in range(layout.num_chunks)]
    holds_first = 0 in stages
    out: list[ParamSpec] = []
    units: dict[str, int] = {}
    for c, s in enumerate(stages):
        last = s == layout.num_stages - 1
        params = _chunk_params(
            cfg,
            split=split,
            etp=etp or tp,
            ep=ep,
            layers=blocks[s],
            first=s == 0,
            last=last,
            borrow=holds_first,
        )
        for name, n, expert, unit in params:
            key = unit if len(stages) == 1 else f"chunk{c}"
            prefix = "" if len(stages) == 1 else f"chunks.{c}."
            out.append(ParamSpec(prefix + name, n, expert, units.setdefault(key, len(units))))
    return tuple(out)


def param_numels(cfg: GPTConfig, *, tp: int, pp: int, pp_rank: int) -> list[tuple[str, int]]:
    """(name, elements) of every trainable parameter of pipeline rank ``pp_rank`` on one TP rank,
    in ``GPTModel``'s registration order (one chunk per rank)."""
    return [(p.name, p.numel) for p in rank_params(cfg, tp=tp, pp=pp, pp_rank=pp_rank)]


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
    grads_in_fp32: bool | None = None,
    schedule: str = "1f1b",
    vp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    edp: int | None = None,
    edp_rank: int = 0,
    offload_fraction: float = 0.0,
    optimizer_place: str = "host",
    optimizer_host_bytes: int = 256 << 20,
    param_place: str = "device",
    param_host_bytes: int = 256 << 20,
    tp_mode: str = "1d",
    tp_depth: int = 1,
) -> ModelStateBytes:
    """The bytes ``memory_report.model_state_bytes`` measures on the rank (``pp_rank``,
    ``dp_rank``), before the first step (Adam moments and one 4-byte step counter per optimized
    tensor or piece counted as the optimizer will allocate them). ``dp``: the dense DP group
    (dp x cp); ``edp`` / ``edp_rank``: the expert DP group of MoE experts (default ``dp``).
    ``bucket_size``: elements per grad bucket (``ParallelConfig.bucket_size``).
    ``grads_in_fp32``: the grad buffers' dtype (``accumulate_allreduce_grads_in_fp32``); None:
    Megatron's default for ``precision`` (fp32 grads for bf16 params, else the params' dtype).
    ``offload_fraction``: the share of each optimizer shard offloaded, to ``optimizer_place``
    (``host``, or ``disk``: files streamed through ``optimizer_host_bytes``). ``param_place``:
    ZeRO-3's param shards on the ``device``, the ``host``, or ``disk`` (files streamed through
    ``param_host_bytes`` of staging). ``tp_mode`` / ``tp_depth``: the tensor-parallel mode
    (``tp_split.TPSplit``)."""
    r = ZERO_RUNGS[rung]
    if not r.available:
        raise NotImplementedError(f"ZeRO rung {rung} is not implemented yet")
    specs = rank_params(
        cfg,
        tp=tp,
        pp=pp,
        pp_rank=pp_rank,
        schedule=schedule,
        vp=vp,
        ep=ep,
        etp=etp,
        tp_mode=tp_mode,
        tp_depth=tp_depth,
    )
    p_bytes = DTYPE_BYTES[precision]
    if grads_in_fp32 is None:
        grads_in_fp32 = precision == "bf16"
    g_bytes = 4 if grads_in_fp32 else p_bytes
    master_bytes = 0 if p_bytes == 4 else 4
    out = ModelStateBytes(0, 0, 0, 0, 0, 0, stage=list(ZERO_RUNGS).index(r.name))
    params_off = r.shard_params and param_place != "device"
    grads_off = r.shard_params and offload_fraction == 1.0  # the wrapper's grad_offload
    staging = 0  # param files: the read and write staging buffers, each of this many bytes
    theory = theory_off = 0.0
    for expert in (False, True):
        mine = [p for p in specs if p.expert == expert]
        if not mine:
            continue
        d, rank = (edp or dp, edp_rank) if expert else (dp, dp_rank)
        numels = [p.numel for p in mine]
        sharded = r.shard_optimizer or r.shard_grads
        groups = None
        if r.shard_params:  # ZeRO-3: one bucket per gather unit, in unit order
            by_unit: dict[int, list[int]] = {}
            for i, p in enumerate(mine):
                by_unit.setdefault(p.unit, []).append(i)
            groups = [by_unit[u] for u in sorted(by_unit)]
        layout = GradBufferLayout(
            numels, bucket_size=bucket_size, pad_multiple=d if sharded else 1, groups=groups
        )
        total = sum(numels)
        out.num_params += total
        if r.shard_optimizer:
            shard = layout.numel // d
            cut = round(offload_fraction * shard)
            if not r.shard_params:
                out.params += layout.numel * p_bytes
            elif param_place == "host":
                out.params_host += shard * p_bytes
            elif param_place == "disk":
                out.params_disk += shard * p_bytes
                staging = max(staging, min(param_host_bytes // 2, shard * p_bytes))
            else:
                out.params += shard * p_bytes
            out.master += (shard - cut) * master_bytes
            # one step counter per piece in memory, a piece cut in two at the offload boundary
            # (the pieces in files have none: their step is streamed)
            in_memory = cut and optimizer_place != "disk"
            pieces = _pieces(layout, d, rank, cut) + (
                _pieces(layout, d, rank, 0, cut) if in_memory else 0
            )
            out.optimizer += 2 * (shard - cut) * 4 + 4 * pieces
            masters_are_params = params_off and p_bytes == 4  # the param shard is the master
            if cut and optimizer_place == "disk":  # the files, and four host buffers of a chunk
                out.disk += (2 if masters_are_params and param_place == "disk" else 3) * cut * 4
                out.host += 4 * max(1, min(cut, optimizer_host_bytes // 24)) * 4
            else:  # fp32 masters and both Adam moments
                out.host += (2 if masters_are_params else 3) * cut * 4
        else:
            out.params += total * p_bytes
            out.master += total * master_bytes
            out.optimizer += sum(2 * n * 4 + 4 for n in numels)
        grads = (layout.numel // d if r.shard_grads else layout.numel) * g_bytes
        if grads_off:
            out.grads_host += grads
        else:
            out.grads += grads
        optim = total * (master_bytes + 8) / (d if r.shard_optimizer else 1)
        param_theory = total * p_bytes / (d if r.shard_params else 1)
        grad_theory = total * g_bytes / (d if r.shard_grads else 1)
        theory += (0 if params_off else param_theory) + (0 if grads_off else grad_theory)
        theory_off += (param_theory if params_off else 0) + (grad_theory if grads_off else 0)
        theory += optim * (1 - offload_fraction)
        theory_off += optim * offload_fraction
    out.params_host += 2 * staging
    out.theory, out.theory_off = round(theory), round(theory_off)
    return out


def _pieces(
    layout: GradBufferLayout, dp: int, dp_rank: int, lo: int = 0, hi: int | None = None
) -> int:
    """Parameters (or parts of one) in shard elements ``[lo, hi)`` of the rank's shard (the
    optimizer splits a piece at the offload cut): one Adam step counter each."""
    segments = layout.shard_segments(dp, dp_rank)
    count = 0
    for p_lo, p_hi, k in layout.param_ranges:
        s_lo, s_hi, start = segments[k]
        a, b = max(p_lo, s_lo), min(p_hi, s_hi)  # buffer coordinates
        if a >= b:
            continue
        a, b = a - s_lo + start, b - s_lo + start  # shard coordinates
        if max(a, lo) < min(b, hi if hi is not None else b):
            count += 1
    return count
