"""megalite <-> HuggingFace ``LlamaForCausalLM``: names, layouts and the config.

Llama keeps q/k/v and gate/up as separate ``[out, in]`` linears. megalite's fused QKV rows are, for
each of the G query groups, ``[q_1 .. q_k, k, v]`` (k = heads / G query heads of ``head_dim`` rows
each), and HF's query head ``j`` belongs to group ``j // k``, so the translation is a reshape. RoPE
uses the same rotate-half convention and inverse frequencies in both. SwiGLU's fc1 is
``[gate; up]``.

    layer i (megalite ``decoder.layers.i.``)      HF ``model.layers.i.``
    input_layernorm / pre_mlp_layernorm           input_layernorm / post_attention_layernorm
    self_attention.linear_qkv                     self_attn.q_proj, k_proj, v_proj
    self_attention.linear_proj                    self_attn.o_proj
    mlp.linear_fc1 = [gate; up], linear_fc2       mlp.gate_proj, up_proj, down_proj

Megatron's math flags: ``--apply-layernorm-1p`` stores norm weights as ``w - 1``: the export
writes ``1 + w`` and the import into such a model subtracts 1. ``--use-rope-scaling`` is HF's
``rope_type "llama3"`` (factor; low / high frequency factors 1 and 4 over 8192 positions, as
Megatron fixes them). HF Llama rotates every channel in rotate-half pairs and has no q/k norms, so
``--rotary-percent`` < 1, ``--rotary-interleaved`` and ``--qk-layernorm`` are refused.
"""

from __future__ import annotations

import torch

from megalite.conversion.errors import ConversionError
from megalite.models.config import GPTConfig
from megalite.models.rotary import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
)

NORM_KEYS = ("layernorm.weight", "final_layernorm.weight")  # megalite names of norm weights


def fold_norm_1p(state: dict[str, torch.Tensor], config: GPTConfig, sign: int) -> dict:
    """``--apply-layernorm-1p`` norm weights (``w - 1``) -> real scales (``sign`` +1,
    export), or back (``sign`` -1, import); other tensors and other models unchanged."""
    if not config.apply_layernorm_1p:
        return state
    return {k: v + sign if k.endswith(NORM_KEYS) else v for k, v in state.items()}


def rope_scaling(config: GPTConfig) -> dict | None:
    """HF's llama3 ``rope_scaling`` of ``--use-rope-scaling``, or None."""
    if not config.use_rope_scaling:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(config.rope_scaling_factor),
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
    }


def check(
    config: GPTConfig,
    *,
    model: str = "LlamaForCausalLM",
    sliding_window: bool = False,
    rope_scaling: bool = True,
) -> None:
    """One-line ConversionError for a model ``model`` (LlamaForCausalLM, or a family built on its
    layers) cannot express; ``sliding_window``: the family has one (Mistral), else a window is
    refused; ``rope_scaling``: its export writes llama3 RoPE scaling (Llama, Mistral), else
    ``--use-rope-scaling`` is refused rather than dropped. No family expresses a block-sparse
    layout."""
    needs = (
        (
            "no --use-rope-scaling (its export writes plain RoPE)",
            rope_scaling or not config.use_rope_scaling,
        ),
        ("--position-embedding-type rope", config.position_embedding_type == "rope"),
        ("--normalization RMSNorm", config.normalization == "RMSNorm"),
        ("--swiglu", config.swiglu),
        ("--disable-bias-linear", not config.add_bias_linear),
        ("no --add-qkv-bias (that is Qwen2)", not config.add_qkv_bias),
        ("no --qk-layernorm (it has no q/k norms)", not config.qk_layernorm),
        ("--rotary-percent 1.0 (it rotates every channel)", config.rotary_percent == 1.0),
        (
            "no --rotary-interleaved (it pairs channel i with i + d/2)",
            not config.rotary_interleaved,
        ),
        (
            "no --window-size (a windowed Llama converts to MistralForCausalLM)",
            sliding_window or config.window_size is None,
        ),
        ("no --sparse-attention (no HF family has its layouts)", config.sparse_attention is None),
    )
    for what, ok in needs:
        if not ok:
            raise ConversionError(f"{model} needs {what}; this model differs")


def config_kwargs(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """The keywords every Llama-family ``transformers.*Config`` (Llama, Mistral, Mixtral, Qwen2,
    Qwen2-MoE) takes from ``config`` alike; each family adds its own (head_dim, RoPE, MoE)."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon,
        hidden_act="silu",
        attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def hf_config(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    """The ``transformers.LlamaConfig`` of ``config``'s model."""
    import transformers

    check(config)
    return transformers.LlamaConfig(
        **config_kwargs(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id),
        head_dim=config.kv_channels,
        rope_theta=float(config.rotary_base),
        rope_scaling=rope_scaling(config),
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
    )


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Logical megalite tensors (global names, unpadded vocabulary) -> LlamaForCausalLM's."""
    check(config)
    state = fold_norm_1p(state, config, +1)  # --apply-layernorm-1p: real scales
    g, k, d, h = (
        config.num_query_groups,
        config.heads_per_group,
        config.kv_channels,
        config.hidden_size,
    )
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"].reshape(g, k + 2, d, h)
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2)
        out |= {
            t + "input_layernorm.weight": state[m + "input_layernorm.weight"],
            t + "post_attention_layernorm.weight": state[m + "pre_mlp_layernorm.weight"],
            t + "self_attn.q_proj.weight": qkv[:, :k].reshape(g * k * d, h),
            t + "self_attn.k_proj.weight": qkv[:, k].reshape(g * d, h),
            t + "self_attn.v_proj.weight": qkv[:, k + 1].reshape(g * d, h),
            t + "self_attn.o_proj.weight": state[m + "self_attention.linear_proj.weight"],
            t + "mlp.gate_proj.weight": gate,
            t + "mlp.up_proj.weight": up,
            t + "mlp.down_proj.weight": state[m + "mlp.linear_fc2.weight"],
        }
    return {k_: v.contiguous() for k_, v in out.items()}


def _rope_params(hf) -> dict:
    """HF's RoPE settings: ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (before)."""
    return getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}


def _rope_scaling_factor(hf) -> float | None:
    """``--use-rope-scaling``: the factor of a llama3 ``rope_type`` with Megatron's fixed
    frequency factors and context (None for the default RoPE); ConversionError for any other
    scaling."""
    params = _rope_params(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    fixed = {
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
    }
    if kind != "llama3" or any(float(params.get(k, v)) != v for k, v in fixed.items()):
        raise ConversionError(
            f"Llama rope_type {kind!r} with {params}: megalite has the default RoPE and llama3 "
            f"scaling with {fixed} (Megatron's --use-rope-scaling)"
        )
    return float(params["factor"])


def _rope_theta(hf) -> float:
    params = _rope_params(hf)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))  # where this version has it
    return float(10000.0 if theta is None else theta)


def config_from_hf(hf) -> GPTConfig:
    """A ``transformers.LlamaConfig`` -> the GPTConfig of the same model."""
    if hf.hidden_act != "silu":
        raise ConversionError(f"Llama hidden_act {hf.hidden_act!r}: megalite's SwiGLU is silu")
    # getattr with a default: fields an older or newer transformers' LlamaConfig may lack
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ConversionError("Llama attention_bias / mlp_bias: megalite's Llama has no biases")
    theta = _rope_theta(hf)
    scaling = _rope_scaling_factor(hf)
    if theta != int(theta):
        raise ConversionError(f"Llama rope_theta {theta} is not an integer (--rotary-base)")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return GPTConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf.num_key_value_heads or heads,
        kv_channels=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        seq_length=hf.max_position_embeddings,
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta),
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
        init_method_std=hf.initializer_range,
        use_rope_scaling=scaling is not None,
        rope_scaling_factor=8.0 if scaling is None else scaling,
    )


def from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors -> logical megalite tensors."""
    s = hf_state
    g, k, d, h = (
        config.num_query_groups,
        config.heads_per_group,
        config.kv_channels,
        config.hidden_size,
    )
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in s:
            raise ConversionError(f"the Llama weights have no {name!r}; is this a Llama model?")
    out = {
        "embedding.word_embeddings.weight": s["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": s["model.norm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        if "lm_head.weight" not in s:
            raise ConversionError(
                "an untied Llama (tie_word_embeddings=False) needs lm_head.weight"
            )
        out["output_layer.weight"] = s["lm_head.weight"]
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        q = s[t + "self_attn.q_proj.weight"].reshape(g, k, d, h)
        kk = s[t + "self_attn.k_proj.weight"].reshape(g, 1, d, h)
        v = s[t + "self_attn.v_proj.weight"].reshape(g, 1, d, h)
        out |= {
            m + "input_layernorm.weight": s[t + "input_layernorm.weight"],
            m + "pre_mlp_layernorm.weight": s[t + "post_attention_layernorm.weight"],
            m + "self_attention.linear_qkv.weight": torch.cat([q, kk, v], 1).reshape(-1, h),
            m + "self_attention.linear_proj.weight": s[t + "self_attn.o_proj.weight"],
            m + "mlp.linear_fc1.weight": torch.cat(
                [s[t + "mlp.gate_proj.weight"], s[t + "mlp.up_proj.weight"]]
            ),
            m + "mlp.linear_fc2.weight": s[t + "mlp.down_proj.weight"],
        }
    out = fold_norm_1p(out, config, -1)  # --apply-layernorm-1p: stored as w - 1
    return {k_: v_.contiguous() for k_, v_ in out.items()}
