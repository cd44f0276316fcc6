"""The ``pretrain_gpt.py`` model flags that build a converted model: ``megalite_flags``."""

from __future__ import annotations

from megalite.models.config import GPTConfig


def _flags(*pairs: tuple[str, str]) -> list[str]:
    """``("--flag", "value")`` pairs as one command line."""
    return [word for pair in pairs for word in pair]


def megalite_flags(config: GPTConfig) -> list[str]:
    """The ``pretrain_gpt.py`` model flags that build ``config``'s model."""
    c = config
    flags = _flags(
        ("--num-layers", str(c.num_layers)),
        ("--hidden-size", str(c.hidden_size)),
        ("--num-attention-heads", str(c.num_attention_heads)),
        ("--ffn-hidden-size", str(c.ffn_hidden_size)),
        ("--max-position-embeddings", str(c.max_position_embeddings)),
        ("--norm-epsilon", repr(c.norm_epsilon)),
    )
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        flags += ["--kv-channels", str(c.kv_channels)]
    if c.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", str(c.rotary_base)]
    if c.normalization != "LayerNorm":
        flags += ["--normalization", c.normalization]
    if c.swiglu:
        flags.append("--swiglu")
    if c.openai_gelu:
        flags.append("--openai-gelu")
    if not c.add_bias_linear:
        flags.append("--disable-bias-linear")
    if c.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    # Megatron's math flags that HF's configs express
    for flag, on in (
        ("--apply-layernorm-1p", c.apply_layernorm_1p),
        ("--qk-layernorm", c.qk_layernorm),
        ("--squared-relu", c.squared_relu),
        ("--rotary-interleaved", c.rotary_interleaved),
    ):
        if on:
            flags.append(flag)
    if c.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(c.rope_scaling_factor)]
    if c.rotary_percent != 1.0:
        flags += ["--rotary-percent", repr(c.rotary_percent)]
    if c.num_experts is not None:  # MoE
        flags += _flags(
            ("--num-experts", str(c.num_experts)),
            ("--moe-router-topk", str(c.moe_router_topk)),
            ("--moe-ffn-hidden-size", str(c.moe_ffn_hidden_size or c.ffn_hidden_size)),
        )
        if c.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if c.moe_layer_freq != 1:
            flags += ["--moe-layer-freq", str(c.moe_layer_freq).replace(" ", "")]
        if c.moe_shared_expert_intermediate_size is not None:
            size = str(c.moe_shared_expert_intermediate_size)
            flags += ["--moe-shared-expert-intermediate-size", size]
        if c.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
    if c.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if c.window_size is not None:
        # windowed attention has no attention dropout (Megatron's default is 0.1)
        flags += ["--window-size", ",".join(str(w) for w in c.window_size)]
        flags += ["--attention-dropout", "0"]
    return flags
