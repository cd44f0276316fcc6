"""megalite <-> HuggingFace ``GPT2LMHeadModel``: names, layouts and the config.

GPT-2 in HF uses ``Conv1D`` layers whose weights are ``[in, out]`` (the transpose of megalite's
``[out, in]`` linears), and its ``c_attn`` output is ``[Q | K | V]`` over all heads, while
megalite's fused QKV rows are ``[q_i, k_i, v_i]`` per head (query groups of one head, DESIGN §5).
The word embedding is tied to the LM head (HF stores only ``transformer.wte.weight``).

    layer i (megalite ``decoder.layers.i.``)      HF ``transformer.h.i.``
    input_layernorm                               ln_1
    self_attention.linear_qkv   [n*3d, h]         attn.c_attn    [h, 3h]  (per head -> Q|K|V, .t())
    self_attention.linear_proj  [h, h]            attn.c_proj    [h, h]   (.t())
    pre_mlp_layernorm                             ln_2
    mlp.linear_fc1 / linear_fc2                   mlp.c_fc / mlp.c_proj   (.t())

Megatron's math flags: ``--squared-relu`` is HF's ``activation_function="relu2"``;
``--apply-layernorm-1p`` norm weights (``w - 1``) are written as ``1 + w`` and read back into such
a model minus 1 (``llama.fold_norm_1p``); GPT-2 has no q/k norms (``--qk-layernorm`` is refused).
"""

from __future__ import annotations

import torch

from megalite.conversion.errors import ConversionError
from megalite.conversion.llama import fold_norm_1p
from megalite.models.config import GPTConfig

ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # -> openai_gelu
SQUARED_RELU = "relu2"  # HF's name of relu(x)^2 (--squared-relu)


def check(config: GPTConfig) -> None:
    """One-line ConversionError for a model GPT2LMHeadModel cannot express."""
    needs = (
        (
            "learned absolute positions (no RoPE)",
            config.position_embedding_type == "learned_absolute",
        ),
        ("--normalization LayerNorm", config.normalization == "LayerNorm"),
        ("no --swiglu", not config.swiglu),
        ("biases (no --disable-bias-linear)", config.add_bias_linear),
        (
            "tied embeddings (no --untie-embeddings-and-output-weights)",
            not config.untie_embeddings_and_output_weights,
        ),
        ("no --group-query-attention", config.num_query_groups == config.num_attention_heads),
        (
            "--kv-channels = hidden / heads",
            config.kv_channels * config.num_attention_heads == config.hidden_size,
        ),
        ("no --qk-layernorm (it has no q/k norms)", not config.qk_layernorm),
        ("no --window-size", config.window_size is None),
        ("no --sparse-attention", config.sparse_attention is None),
    )
    for what, ok in needs:
        if not ok:
            raise ConversionError(f"GPT2LMHeadModel needs {what}; this model differs")


def hf_config(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    """The ``transformers.GPT2Config`` of ``config``'s model."""
    import transformers

    check(config)
    return transformers.GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function=(
            SQUARED_RELU if config.squared_relu else "gelu_new" if config.openai_gelu else "gelu"
        ),
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.norm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        architectures=["GPT2LMHeadModel"],
    )


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Logical megalite tensors (global names, unpadded vocabulary) -> GPT2LMHeadModel's."""
    check(config)
    state = fold_norm_1p(state, config, +1)  # --apply-layernorm-1p: real scales
    n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv_w = state[m + "self_attention.linear_qkv.weight"].reshape(n, 3, d, h)
        qkv_b = state[m + "self_attention.linear_qkv.bias"].reshape(n, 3, d)
        out |= {
            t + "ln_1.weight": state[m + "input_layernorm.weight"],
            t + "ln_1.bias": state[m + "input_layernorm.bias"],
            t + "attn.c_attn.weight": qkv_w.transpose(0, 1).reshape(3 * n * d, h).t(),
            t + "attn.c_attn.bias": qkv_b.transpose(0, 1).reshape(3 * n * d),
            t + "attn.c_proj.weight": state[m + "self_attention.linear_proj.weight"].t(),
            t + "attn.c_proj.bias": state[m + "self_attention.linear_proj.bias"],
            t + "ln_2.weight": state[m + "pre_mlp_layernorm.weight"],
            t + "ln_2.bias": state[m + "pre_mlp_layernorm.bias"],
            t + "mlp.c_fc.weight": state[m + "mlp.linear_fc1.weight"].t(),
            t + "mlp.c_fc.bias": state[m + "mlp.linear_fc1.bias"],
            t + "mlp.c_proj.weight": state[m + "mlp.linear_fc2.weight"].t(),
            t + "mlp.c_proj.bias": state[m + "mlp.linear_fc2.bias"],
        }
    return {k: v.contiguous() for k, v in out.items()}


def config_from_hf(hf) -> GPTConfig:
    """A ``transformers.GPT2Config`` -> the GPTConfig of the same model."""
    act = hf.activation_function
    if act not in ACTIVATIONS and act != SQUARED_RELU:
        raise ConversionError(
            f"GPT-2 activation_function {act!r} has no megalite equivalent (use one of "
            f"{', '.join(ACTIVATIONS)})"
        )
    # getattr with a default: fields an older or newer transformers' GPT2Config may lack
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf, flag, False):
            raise ConversionError(f"GPT-2 {flag}=True has no megalite equivalent")
    if not getattr(hf, "scale_attn_weights", True):
        raise ConversionError("GPT-2 scale_attn_weights=False has no megalite equivalent")
    if not getattr(hf, "tie_word_embeddings", True):
        raise ConversionError("an untied GPT-2 LM head has no GPT2LMHeadModel-compatible layout")
    return GPTConfig(
        num_layers=hf.n_layer,
        hidden_size=hf.n_embd,
        num_attention_heads=hf.n_head,
        vocab_size=hf.vocab_size,
        seq_length=hf.n_positions,
        max_position_embeddings=hf.n_positions,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
        openai_gelu=ACTIVATIONS.get(act, False),
        squared_relu=act == SQUARED_RELU,
        norm_epsilon=hf.layer_norm_epsilon,
        init_method_std=hf.initializer_range,
    )


def from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (with or without the ``transformer.`` prefix) -> logical megalite
    tensors."""
    s = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    _require(s, ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"])
    out = {
        "embedding.word_embeddings.weight": s["wte.weight"],
        "embedding.position_embeddings.weight": s["wpe.weight"],
        "decoder.final_layernorm.weight": s["ln_f.weight"],
        "decoder.final_layernorm.bias": s["ln_f.bias"],
    }
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"h.{i}."
        _require(s, [t + "attn.c_attn.weight", t + "mlp.c_fc.weight"])
        qkv_w = s[t + "attn.c_attn.weight"].t().reshape(3, n, d, h)  # rows [Q; K; V]
        qkv_b = s[t + "attn.c_attn.bias"].reshape(3, n, d)
        out |= {
            m + "input_layernorm.weight": s[t + "ln_1.weight"],
            m + "input_layernorm.bias": s[t + "ln_1.bias"],
            m + "self_attention.linear_qkv.weight": qkv_w.transpose(0, 1).reshape(3 * n * d, h),
            m + "self_attention.linear_qkv.bias": qkv_b.transpose(0, 1).reshape(3 * n * d),
            m + "self_attention.linear_proj.weight": s[t + "attn.c_proj.weight"].t(),
            m + "self_attention.linear_proj.bias": s[t + "attn.c_proj.bias"],
            m + "pre_mlp_layernorm.weight": s[t + "ln_2.weight"],
            m + "pre_mlp_layernorm.bias": s[t + "ln_2.bias"],
            m + "mlp.linear_fc1.weight": s[t + "mlp.c_fc.weight"].t(),
            m + "mlp.linear_fc1.bias": s[t + "mlp.c_fc.bias"],
            m + "mlp.linear_fc2.weight": s[t + "mlp.c_proj.weight"].t(),
            m + "mlp.linear_fc2.bias": s[t + "mlp.c_proj.bias"],
        }
    out = fold_norm_1p(out, config, -1)  # --apply-layernorm-1p: stored as w - 1
    return {k: v.contiguous() for k, v in out.items()}


def _require(state: dict, names: list[str]) -> None:
    for name in names:
        if name not in state:
            raise ConversionError(f"the GPT-2 weights have no {name!r}; is this a GPT-2 model?")
