"""What a Megatron-LM checkpoint's ``args`` fix: the model's shapes, its math flags, its stages.

Megatron records its run's settings as the ``argparse.Namespace`` it parsed, under ``args`` in
every ``model_optim_rng.pt`` (``torch``) or ``common.pt`` (``torch_dist``). The fields differ
between Megatron versions, so every one is read with ``arg`` (the default when the field is absent
or None). The model settings come back as megalite's ``GPTConfig`` fields
(``model_config_from_args``, checked as a megalite checkpoint's are); the ones megalite implements
beyond the shapes (``MATH_FLAGS``) must equal this run's flags, and a checkpoint of a model megalite
does not build (``UNREAD_MODEL_ARGS``) is refused, each in one line.
"""

from __future__ import annotations

from megalite.checkpoint.files import CheckpointError
from megalite.core.pipeline_parallel.stages import stage_layer_ranges


def arg(args, name: str, default=None):
    """``args.name``, or ``default`` where this Megatron version did not record it (or None):
    ``args`` is a foreign Namespace whose fields vary between Megatron versions."""
    value = getattr(args, name, default)
    return default if value is None else value


def model_config_from_args(args) -> dict:
    """The GPTConfig fields a Megatron run's ``args`` fix (for ``check_model_compatible``)."""
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if arg(args, "group_query_attention", False) else heads
    hidden = int(args.hidden_size)
    if arg(args, "num_experts"):
        raise CheckpointError(
            "a Megatron MoE checkpoint (--num-experts) is not read: megalite reads Megatron's "
            "dense checkpoints; convert the MoE model through HuggingFace instead"
        )
    return {
        "num_layers": int(args.num_layers),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": int(arg(args, "kv_channels", hidden // heads)),
        "ffn_hidden_size": int(arg(args, "ffn_hidden_size", 4 * hidden)),
        "max_position_embeddings": int(arg(args, "max_position_embeddings", args.seq_length)),
        "position_embedding_type": arg(args, "position_embedding_type", "learned_absolute"),
        "normalization": arg(args, "normalization", "LayerNorm"),
        "swiglu": bool(arg(args, "swiglu", False)),
        "add_bias_linear": bool(arg(args, "add_bias_linear", True)),
        "untie_embeddings_and_output_weights": bool(
            arg(args, "untie_embeddings_and_output_weights", False)
        ),
        "rotary_base": int(arg(args, "rotary_base", 10000)),
        "norm_epsilon": float(arg(args, "norm_epsilon", 1e-5)),
        "openai_gelu": bool(arg(args, "openai_gelu", False)),
    }


# Megatron's model flags that megalite implements beyond the shapes ``model_config_from_args``
# gives: (args name, GPTConfig field, flag, Megatron's default); a difference from this run's
# flags is refused (``check_math_flags``): the tensors would load into another function.
MATH_FLAGS = (
    ("add_qkv_bias", "add_qkv_bias", "--add-qkv-bias", False),
    ("qk_layernorm", "qk_layernorm", "--qk-layernorm", False),
    ("apply_layernorm_1p", "apply_layernorm_1p", "--apply-layernorm-1p", False),
    ("squared_relu", "squared_relu", "--squared-relu", False),
    ("rotary_percent", "rotary_percent", "--rotary-percent", 1.0),
    ("rotary_interleaved", "rotary_interleaved", "--rotary-interleaved", False),
    ("use_rope_scaling", "use_rope_scaling", "--use-rope-scaling", False),
    ("rope_scaling_factor", "rope_scaling_factor", "--rope-scaling-factor", 8.0),
)
# Megatron model settings megalite has no equivalent for: a checkpoint that uses one is refused
UNREAD_MODEL_ARGS = (
    ("multi_latent_attention", "--multi-latent-attention"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("linear_attention_freq", "--linear-attention-freq"),
    ("is_hybrid_model", "a hybrid (Mamba) model"),
)


def math_flags_from_args(args) -> dict:
    """The values of ``MATH_FLAGS`` a Megatron run's ``args`` hold (Megatron's defaults where an
    older Megatron did not record one), normalised as megalite builds the model."""
    out = {field: arg(args, name, default) for name, field, _, default in MATH_FLAGS}
    out["add_qkv_bias"] = bool(out["add_qkv_bias"]) or bool(arg(args, "add_bias_linear", True))
    if arg(args, "position_embedding_type", "learned_absolute") != "rope":
        for key in ("rotary_percent", "rotary_interleaved", "use_rope_scaling"):
            out.pop(key)
    if not out.get("use_rope_scaling"):
        out.pop("rope_scaling_factor")
    return out


def check_math_flags(args, current, *, where: str) -> None:
    """Refuse, in one line, a Megatron checkpoint whose ``args`` name a model setting this run's
    flags contradict (``MATH_FLAGS``) or one megalite does not implement (``UNREAD_MODEL_ARGS``)."""
    for name, flag in UNREAD_MODEL_ARGS:
        if arg(args, name, None) not in (None, False, 0):
            raise CheckpointError(
                f"Megatron checkpoint {where} was trained with {flag} "
                f"{arg(args, name)!r}, which megalite does not implement; it cannot be loaded"
            )
    saved = math_flags_from_args(args)
    now = {field: getattr(current, field) for _, field, _, _ in MATH_FLAGS}
    now["add_qkv_bias"] = bool(now["add_qkv_bias"]) or bool(current.add_bias_linear)
    for _, field, flag, _ in MATH_FLAGS:
        if field in saved and saved[field] != now[field]:
            raise CheckpointError(
                f"Megatron checkpoint {where} was trained with {flag} {saved[field]!r} but this "
                f"run has {now[field]!r}; give the checkpoint's {flag} setting"
            )


def layer_ranges_from_args(args) -> list[tuple[int, int]]:
    """The ``[start, end)`` layers of each of the Megatron run's pipeline stages."""
    pp = int(arg(args, "pipeline_model_parallel_size", 1))
    if arg(args, "num_layers_per_virtual_pipeline_stage") or arg(
        args, "num_virtual_stages_per_pipeline_rank"
    ):
        raise CheckpointError(
            "a Megatron checkpoint with virtual pipeline stages (model0, model1, ... per file) is "
            "not read; save it from Megatron without them, or convert it"
        )
    uneven = pp > 1
    return [
        tuple(r)
        for r in stage_layer_ranges(
            int(args.num_layers),
            pp,
            first_stage_layers=arg(args, "decoder_first_pipeline_num_layers") if uneven else None,
            last_stage_layers=arg(args, "decoder_last_pipeline_num_layers") if uneven else None,
        )
    ]
