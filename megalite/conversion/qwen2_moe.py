"""megalite <-> HuggingFace ``Qwen2MoeForCausalLM`` and the dense ``Qwen2ForCausalLM``.

Both are Llama's mapping (RMSNorm, RoPE, SwiGLU, no linear biases) plus a bias on q/k/v
(megalite's ``--add-qkv-bias``: ``linear_qkv.bias``, laid out per query group as the weight's rows).
Qwen2-MoE adds, per MoE layer (HF ``model.layers.i.mlp.``, megalite ``decoder.layers.i.mlp.``):

    router.weight # [E, h]                          gate.weight
    experts.weight1[j] # [2f, h] ([gate; up])       experts.j.gate_proj / up_proj .weight
    experts.weight2[j] # [h, f]                     experts.j.down_proj.weight
    shared_experts.linear_fc1 = [gate; up]          shared_expert.gate_proj / up_proj
    shared_experts.linear_fc2                       shared_expert.down_proj
    shared_experts_gate.weight # [1, h]             shared_expert_gate.weight (sigmoid gate)

(transformers' in-memory ``experts.gate_up_proj`` / ``down_proj`` are read too). Routing:
``norm_topk_prob`` True is megalite's softmax over the chosen logits, False is
``--moe-router-pre-softmax`` (softmax over all experts, top-k, not renormalised). Which layers
are MoE (``decoder_sparse_step``, ``mlp_only_layers``) becomes a ``--moe-layer-freq`` list; the
dense layers' MLP is ``intermediate_size``, the experts' ``moe_intermediate_size``.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.conversion import llama
from megalite.conversion.errors import ConversionError
from megalite.conversion.mixtral import experts_from_hf, experts_to_hf
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern

QWEN2_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _needs(model: str, needs) -> None:
    for what, ok in needs:
        if not ok:
            raise ConversionError(f"{model} needs {what}; this model differs")


def _llama_view(config: GPTConfig) -> GPTConfig:
    """The Llama config of the same attention and dense MLPs (no qkv bias, no experts)."""
    return dataclasses.replace(
        config,
        add_qkv_bias=False,
        num_experts=None,
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
    )


def check_dense(config: GPTConfig) -> None:
    """One-line ConversionError for a model Qwen2ForCausalLM cannot express."""
    llama.check(_llama_view(config), model="Qwen2ForCausalLM", rope_scaling=False)
    _needs(
        "Qwen2ForCausalLM",
        (("--add-qkv-bias", config.add_qkv_bias), ("no --num-experts", config.num_experts is None)),
    )


def check(config: GPTConfig) -> None:
    """One-line ConversionError for a model Qwen2MoeForCausalLM cannot express."""
    llama.check(_llama_view(config), model="Qwen2MoeForCausalLM", rope_scaling=False)
    _needs(
        "Qwen2MoeForCausalLM",
        (
            ("--num-experts", config.num_experts is not None),
            ("--moe-router-score-function softmax", config.moe_router_score_function == "softmax"),
            (
                "--moe-shared-expert-intermediate-size",
                config.moe_shared_expert_intermediate_size is not None,
            ),
            ("--moe-shared-expert-gate", config.moe_shared_expert_gate),
            ("no --moe-router-enable-expert-bias", not config.moe_router_enable_expert_bias),
        ),
    )


def _rope_theta(config: GPTConfig) -> float:
    return float(config.rotary_base)


def hf_config_dense(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    import transformers

    check_dense(config)
    hf = transformers.Qwen2Config(
        **llama.config_kwargs(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id),
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(config)},
        architectures=["Qwen2ForCausalLM"],
    )
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        hf.head_dim = config.kv_channels
    return hf


def hf_config(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    import transformers

    check(config)
    pattern = moe_layer_pattern(config)
    hf = transformers.Qwen2MoeConfig(
        **llama.config_kwargs(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id),
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(config)},
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        num_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk,
        norm_topk_prob=not config.moe_router_pre_softmax,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        qkv_bias=config.add_qkv_bias,
        architectures=["Qwen2MoeForCausalLM"],
    )
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        hf.head_dim = config.kv_channels  # Qwen2-MoE derives it from hidden / heads
    return hf


# --- the q/k/v bias ------------------------------------------------------------------------------


def _groups(config: GPTConfig) -> tuple[int, int, int]:
    return config.num_query_groups, config.heads_per_group, config.kv_channels


def _bias_to_hf(state: dict, config: GPTConfig, out: dict) -> None:
    g, k, d = _groups(config)
    for i in range(config.num_layers):
        b = state[f"decoder.layers.{i}.self_attention.linear_qkv.bias"].reshape(g, k + 2, d)
        t = f"model.layers.{i}.self_attn."
        out[t + "q_proj.bias"] = b[:, :k].reshape(-1).contiguous()
        out[t + "k_proj.bias"] = b[:, k].reshape(-1).contiguous()
        out[t + "v_proj.bias"] = b[:, k + 1].reshape(-1).contiguous()


def _bias_from_hf(s: dict, config: GPTConfig, out: dict) -> None:
    g, k, d = _groups(config)
    for i in range(config.num_layers):
        t = f"model.layers.{i}.self_attn."
        if t + "q_proj.bias" not in s:
            raise ConversionError(f"the Qwen2 weights have no {t}q_proj.bias (qkv_bias)")
        q = s[t + "q_proj.bias"].reshape(g, k, d)
        kk, v = s[t + "k_proj.bias"].reshape(g, 1, d), s[t + "v_proj.bias"].reshape(g, 1, d)
        out[f"decoder.layers.{i}.self_attention.linear_qkv.bias"] = torch.cat(
            [q, kk, v], 1
        ).reshape(-1)


# --- the dense Qwen2 -----------------------------------------------------------------------------


def to_hf_dense(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    check_dense(config)
    out = llama.to_hf(state, _llama_view(config))
    _bias_to_hf(state, config, out)
    return out


def _check_attention(hf) -> None:
    # getattr with a default here and below: fields some transformers versions' configs lack
    if getattr(hf, "use_sliding_window", False):
        raise ConversionError(
            "Qwen2 use_sliding_window: megalite's attention is full causal; convert a model "
            "with use_sliding_window false"
        )


def config_from_hf_dense(hf) -> GPTConfig:
    """A ``transformers.Qwen2Config`` -> the GPTConfig of the same model."""
    _check_attention(hf)
    return dataclasses.replace(llama.config_from_hf(hf), add_qkv_bias=True)


def from_hf_dense(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    out = llama.from_hf(hf_state, _llama_view(config))
    _bias_from_hf(hf_state, config, out)
    return out


# --- Qwen2-MoE -----------------------------------------------------------------------------------


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Logical megalite tensors -> Qwen2MoeForCausalLM's (the per-expert layout on disk)."""
    check(config)
    pattern = moe_layer_pattern(config)
    dense = dict(state)
    for i in (i for i, moe in enumerate(pattern) if moe):  # placeholders, dropped below
        dense[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.zeros(2, 1)
        dense[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = torch.zeros(1, 1)
    out = llama.to_hf(dense, _llama_view(config))
    if config.add_qkv_bias:
        _bias_to_hf(state, config, out)
    for i in (i for i, moe in enumerate(pattern) if moe):
        m, t = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del out[f"{t}{name}.weight"]
        out[t + "gate.weight"] = state[m + "router.weight"].contiguous()
        out.update(experts_to_hf(state, m, t + "experts.", QWEN2_EXPERT_NAMES))
        gate, up = state[m + "shared_experts.linear_fc1.weight"].chunk(2)
        out[t + "shared_expert.gate_proj.weight"] = gate.contiguous()
        out[t + "shared_expert.up_proj.weight"] = up.contiguous()
        out[t + "shared_expert.down_proj.weight"] = state[m + "shared_experts.linear_fc2.weight"]
        out[t + "shared_expert_gate.weight"] = state[m + "shared_experts_gate.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_moe_layers(hf) -> list[bool]:
    """Qwen2-MoE's rule: layer i is MoE unless listed in ``mlp_only_layers``, when experts exist
    and ``(i + 1) % decoder_sparse_step == 0``."""
    only = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return [
        i not in only and hf.num_experts > 0 and (i + 1) % step == 0
        for i in range(hf.num_hidden_layers)
    ]


def config_from_hf(hf) -> GPTConfig:
    """A ``transformers.Qwen2MoeConfig`` -> the GPTConfig of the same model."""
    _check_attention(hf)
    if not hf.shared_expert_intermediate_size:
        raise ConversionError(
            "Qwen2-MoE shared_expert_intermediate_size 0: megalite's Qwen2-MoE has a shared expert"
        )
    hf.attention_bias, hf.mlp_bias = False, False
    base = llama.config_from_hf(hf)
    pattern = hf_moe_layers(hf)
    if not any(pattern):
        raise ConversionError("this Qwen2-MoE has no MoE layer (mlp_only_layers, num_experts)")
    freq = 1 if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"
    return dataclasses.replace(
        base,
        add_qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        num_experts=hf.num_experts,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_pre_softmax=not hf.norm_topk_prob,
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
        moe_layer_freq=freq,
        moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        moe_token_dispatcher_type="alltoall",
    )


def _experts(s: dict, t: str, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight1 # [E, 2f, h], weight2 # [E, h, f]) from either transformers layout."""
    if t + "experts.gate_up_proj" in s:
        return s[t + "experts.gate_up_proj"], s[t + "experts.down_proj"]
    if t + "experts.0.gate_proj.weight" not in s:
        raise ConversionError(f"the Qwen2-MoE weights have no experts under {t}experts")
    return experts_from_hf(s, t + "experts.", num_experts, QWEN2_EXPERT_NAMES)


def from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Qwen2MoeForCausalLM's tensors -> logical megalite tensors."""
    s = dict(hf_state)
    pattern = moe_layer_pattern(config)
    d = config.moe_ffn_hidden_size or config.ffn_hidden_size
    h = config.hidden_size
    for i in (i for i, moe in enumerate(pattern) if moe):  # placeholders, dropped below
        t = f"model.layers.{i}.mlp."
        s[t + "gate_proj.weight"] = s[t + "up_proj.weight"] = torch.zeros(1, h)
        s[t + "down_proj.weight"] = torch.zeros(h, 1)
    out = llama.from_hf(s, _llama_view(config))
    if config.add_qkv_bias:
        _bias_from_hf(hf_state, config, out)
    for i in (i for i, moe in enumerate(pattern) if moe):
        m, t = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        del out[m + "linear_fc1.weight"], out[m + "linear_fc2.weight"]
        if t + "gate.weight" not in hf_state:
            raise ConversionError(f"the Qwen2-MoE weights have no router {t}gate.weight")
        w1, w2 = _experts(hf_state, t, config.num_experts)
        if tuple(w1.shape[1:]) != (2 * d, h):
            raise ConversionError(
                f"{t} experts have shape {tuple(w1.shape)}, need [E, {2 * d}, {h}]"
            )
        out[m + "router.weight"] = hf_state[t + "gate.weight"]
        out[m + "experts.weight1"] = w1
        out[m + "experts.weight2"] = w2
        gate = hf_state[t + "shared_expert.gate_proj.weight"]
        up = hf_state[t + "shared_expert.up_proj.weight"]
        out[m + "shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "shared_experts.linear_fc2.weight"] = hf_state[t + "shared_expert.down_proj.weight"]
        out[m + "shared_experts_gate.weight"] = hf_state[t + "shared_expert_gate.weight"]
    return {k: v.contiguous() for k, v in out.items()}


class Dense:
    """The dense Qwen2 family as a module-like object for the conversion registry."""

    check = staticmethod(check_dense)
    hf_config = staticmethod(hf_config_dense)
    to_hf = staticmethod(to_hf_dense)
    from_hf = staticmethod(from_hf_dense)
    config_from_hf = staticmethod(config_from_hf_dense)
