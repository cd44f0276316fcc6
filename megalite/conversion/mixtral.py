"""megalite <-> HuggingFace ``MixtralForCausalLM``: Llama's attention and norms, MoE MLPs.

Mixtral routes each token to its top-k experts by softmax over the chosen logits (megalite's
default softmax router without pre-softmax), experts are SwiGLU without bias, every layer is MoE.
Mixtral's files keep one tensor per expert (transformers >= 5 fuses them in memory, as megalite's
stacked weights, and writes them back per expert):

    megalite ``decoder.layers.i.mlp.``           HF ``model.layers.i.block_sparse_moe.``
    router.weight # [E, h]                       gate.weight
    experts.weight1[j] # [2f, h] ([gate; up])    experts.j.w1.weight (gate), experts.j.w3 (up)
    experts.weight2[j] # [h, f]                  experts.j.w2.weight

(the in-memory names ``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj`` are read too).
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.conversion import llama
from megalite.conversion.errors import ConversionError
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern

_ATTENTION = ("input_layernorm", "post_attention_layernorm", "self_attn.")


def check(config: GPTConfig) -> None:
    """One-line ConversionError for a model MixtralForCausalLM cannot express."""
    llama.check(config, model="MixtralForCausalLM", rope_scaling=False)
    needs = (
        ("--num-experts", config.num_experts is not None),
        ("--moe-layer-freq 1", all(moe_layer_pattern(config))),
        ("--moe-router-score-function softmax", config.moe_router_score_function == "softmax"),
        ("no --moe-router-pre-softmax", not config.moe_router_pre_softmax),
        ("no shared experts", config.moe_shared_expert_intermediate_size is None),
        ("no --moe-router-enable-expert-bias", not config.moe_router_enable_expert_bias),
    )
    for what, ok in needs:
        if not ok:
            raise ConversionError(f"MixtralForCausalLM needs {what}; this model differs")


def hf_config(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    import transformers

    check(config)
    kwargs = llama.config_kwargs(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return transformers.MixtralConfig(
        **kwargs | {"intermediate_size": config.moe_ffn_hidden_size or config.ffn_hidden_size},
        head_dim=config.kv_channels,
        rope_theta=float(config.rotary_base),
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        architectures=["MixtralForCausalLM"],
    )


def _dense_view(config: GPTConfig) -> GPTConfig:
    """The Llama config of the same attention (for the shared parts of the mapping)."""
    return dataclasses.replace(config, num_experts=None, moe_aux_loss_coeff=0.0)


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Logical megalite tensors -> MixtralForCausalLM's (transformers >= 5 names)."""
    check(config)
    dense = dict(state)
    for i in range(config.num_layers):  # placeholders so Llama's mapping runs; dropped below
        dense[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.zeros(2, 1)
        dense[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = torch.zeros(1, 1)
    out = {k: v for k, v in llama.to_hf(dense, _dense_view(config)).items() if ".mlp." not in k}
    for i in range(config.num_layers):  # the checkpoint layout on disk (per expert)
        m, t = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[t + "gate.weight"] = state[m + "router.weight"].contiguous()
        out.update(experts_to_hf(state, m, t + "experts.", MIXTRAL_EXPERT_NAMES))
    return out


MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def experts_to_hf(state: dict, m: str, t: str, names: tuple[str, str, str]) -> dict:
    """megalite's stacked ``{m}experts.weight1`` ([E, 2f, h], [gate; up]) and ``weight2`` as HF's
    per-expert ``{t}{e}.{gate|up|down name}.weight`` tensors."""
    out = {}
    gate_name, up_name, down_name = names
    for e, (w1, w2) in enumerate(zip(state[m + "experts.weight1"], state[m + "experts.weight2"])):
        gate, up = w1.chunk(2)
        out[f"{t}{e}.{gate_name}.weight"] = gate.contiguous()
        out[f"{t}{e}.{up_name}.weight"] = up.contiguous()
        out[f"{t}{e}.{down_name}.weight"] = w2.contiguous()
    return out


def experts_from_hf(s: dict, t: str, num_experts: int, names: tuple[str, str, str]):
    """The inverse of ``experts_to_hf``: (weight1 # [E, 2f, h], weight2 # [E, h, f])."""
    gate_name, up_name, down_name = names
    gates = [s[f"{t}{e}.{gate_name}.weight"] for e in range(num_experts)]
    ups = [s[f"{t}{e}.{up_name}.weight"] for e in range(num_experts)]
    w1 = torch.stack([torch.cat([gate, up]) for gate, up in zip(gates, ups)])
    w2 = torch.stack([s[f"{t}{e}.{down_name}.weight"] for e in range(num_experts)])
    return w1, w2


def config_from_hf(hf) -> GPTConfig:
    """A ``transformers.MixtralConfig`` -> the GPTConfig of the same model."""
    hf.attention_bias, hf.mlp_bias = False, False
    base = llama.config_from_hf(hf)
    return dataclasses.replace(
        base,
        num_experts=hf.num_local_experts,
        moe_ffn_hidden_size=hf.intermediate_size,
        moe_router_topk=hf.num_experts_per_tok,
        # absent from some transformers versions' MixtralConfig
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
        moe_token_dispatcher_type="alltoall",
    )


def _experts(s: dict, t: str, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight1 # [E, 2f, h], weight2 # [E, h, f]) from either transformers layout."""
    if t + "mlp.experts.gate_up_proj" in s:
        return s[t + "mlp.experts.gate_up_proj"], s[t + "mlp.experts.down_proj"]
    old = t + "block_sparse_moe.experts."
    if old + "0.w1.weight" not in s:
        raise ConversionError(
            f"the Mixtral weights have no experts under {t}mlp or block_sparse_moe"
        )
    return experts_from_hf(s, old, num_experts, MIXTRAL_EXPERT_NAMES)


def from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM's tensors -> logical megalite tensors."""
    s = dict(hf_state)
    d = config.moe_ffn_hidden_size or config.ffn_hidden_size
    h = config.hidden_size
    for i in range(config.num_layers):  # placeholders for Llama's mapping, dropped below
        t = f"model.layers.{i}.mlp."
        s[t + "gate_proj.weight"] = s[t + "up_proj.weight"] = torch.zeros(1, h)
        s[t + "down_proj.weight"] = torch.zeros(h, 1)
    out = {k: v for k, v in llama.from_hf(s, _dense_view(config)).items() if ".mlp." not in k}
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.mlp.", f"model.layers.{i}."
        router = hf_state.get(
            t + "mlp.gate.weight", hf_state.get(t + "block_sparse_moe.gate.weight")
        )
        if router is None:
            raise ConversionError(f"the Mixtral weights have no router {t}mlp.gate.weight")
        w1, w2 = _experts(hf_state, t, config.num_experts)
        if tuple(w1.shape[1:]) != (2 * d, h):
            raise ConversionError(
                f"{t} experts have shape {tuple(w1.shape)}, need [E, {2 * d}, {h}]"
            )
        out[m + "router.weight"] = router.contiguous()
        out[m + "experts.weight1"] = w1.contiguous()
        out[m + "experts.weight2"] = w2.contiguous()
    return out
