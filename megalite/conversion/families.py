"""The HuggingFace model families megalite converts, and which one a model belongs to.

The family follows from the model's flags: learned positions + LayerNorm + GELU + biases + tied
embeddings is GPT-2; RoPE + RMSNorm + SwiGLU without biases is Llama (Mistral with a sliding
window); Llama's with a q/k/v bias is Qwen2; with MoE experts, Mixtral or Qwen2-MoE (a shared
expert); anything else is refused. Each
family is a module (or ``qwen2_moe.Dense``) with ``check``, ``hf_config``, ``to_hf``,
``config_from_hf`` and ``from_hf``.
"""

from __future__ import annotations

from megalite.conversion import gpt2, llama, mistral, mixtral, qwen2_moe
from megalite.conversion.errors import ConversionError
from megalite.models.config import GPTConfig

FAMILIES = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen2": qwen2_moe.Dense,
    "qwen2_moe": qwen2_moe,
}
HF_MODEL_TYPES = {name: name for name in FAMILIES}  # HF config.model_type -> family


def family_of(config: GPTConfig) -> str:
    """The HF family that expresses ``config``'s model: "gpt2", "llama", "mistral", "qwen2",
    "mixtral" or "qwen2_moe"; a ConversionError naming what disagrees otherwise."""
    if config.num_experts is not None:  # Mixtral unless only Qwen2-MoE fits
        try:
            mixtral.check(config)
            return "mixtral"
        except ConversionError:
            if config.moe_shared_expert_intermediate_size is None:
                raise
        qwen2_moe.check(config)
        return "qwen2_moe"
    if config.add_qkv_bias:  # a bias on q/k/v only: Qwen2
        qwen2_moe.check_dense(config)
        return "qwen2"
    if config.position_embedding_type == "rope" and config.window_size is not None:
        mistral.check(config)
        return "mistral"
    if config.position_embedding_type == "rope":
        llama.check(config)
        return "llama"
    gpt2.check(config)
    return "gpt2"
