"""GPTModel computes the same function as HuggingFace's GPT2LMHeadModel and LlamaForCausalLM.

The HF models are built offline from a config (no download) and given megalite's weights, translated
here from megalite's layout (per-query-group fused QKV, ``[gate; up]`` fc1, ``[out, in]`` linears)
to HF's (GPT-2's head-major ``c_attn`` of Conv1D ``[in, out]`` weights; Llama's separate q/k/v and
gate/up). This pins the semantics the HF converter relies on: RoPE's rotate_half convention and
inv_freq, where RMSNorm's epsilon goes, the GELU variant, the attention scale, learned positions,
tied vs untied output layer.

Tolerance: logits within 2e-5 absolute (they are O(1)), per-token loss within 1e-5 relative. Both
are fp32 on CPU; the implementations differ only in op order (fused QKV vs separate projections,
[s, b] vs [b, s] layouts), i.e. a few ulps per op. A wrong convention (tanh vs exact GELU, another
RoPE base, eps placement) moves the logits by >= 4e-4 here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.models.helpers import make_config

transformers = pytest.importorskip("transformers")

SEQ = 16


def _gpt2_hf(model: GPTModel, config) -> torch.nn.Module:
    hf_config = transformers.GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function="gelu_new" if config.openai_gelu else "gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=config.norm_epsilon,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    src = {k: v.detach() for k, v in model.state_dict().items()}
    n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    v = config.vocab_size
    dst = {
        "transformer.wte.weight": src["embedding.word_embeddings.weight"][:v],
        "transformer.wpe.weight": src["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": src["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": src["decoder.final_layernorm.bias"],
    }
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"transformer.h.{i}."
        # megalite rows per head [q_i, k_i, v_i] -> HF columns [Q | K | V], heads in order
        qkv_w = src[m + "self_attention.linear_qkv.weight"].view(n, 3, d, h)
        qkv_b = src[m + "self_attention.linear_qkv.bias"].view(n, 3, d)
        dst.update(
            {
                t + "ln_1.weight": src[m + "input_layernorm.weight"],
                t + "ln_1.bias": src[m + "input_layernorm.bias"],
                t + "attn.c_attn.weight": qkv_w.transpose(0, 1).reshape(3 * h, h).t(),
                t + "attn.c_attn.bias": qkv_b.transpose(0, 1).reshape(3 * h),
                t + "attn.c_proj.weight": src[m + "self_attention.linear_proj.weight"].t(),
                t + "attn.c_proj.bias": src[m + "self_attention.linear_proj.bias"],
                t + "ln_2.weight": src[m + "pre_mlp_layernorm.weight"],
                t + "ln_2.bias": src[m + "pre_mlp_layernorm.bias"],
                t + "mlp.c_fc.weight": src[m + "mlp.linear_fc1.weight"].t(),
                t + "mlp.c_fc.bias": src[m + "mlp.linear_fc1.bias"],
                t + "mlp.c_proj.weight": src[m + "mlp.linear_fc2.weight"].t(),
                t + "mlp.c_proj.bias": src[m + "mlp.linear_fc2.bias"],
            }
        )
    _load(hf, dst)
    return hf


def _llama_hf(model: GPTModel, config) -> torch.nn.Module:
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon,
        rope_theta=float(config.rotary_base),
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    src = {k: v.detach() for k, v in model.state_dict().items()}
    g, k, d, h = (
        config.num_query_groups,
        config.heads_per_group,
        config.kv_channels,
        config.hidden_size,
    )
    v = config.vocab_size
    dst = {
        "model.embed_tokens.weight": src["embedding.word_embeddings.weight"][:v],
        "model.norm.weight": src["decoder.final_layernorm.weight"],
        "lm_head.weight": src["output_layer.weight"][:v],
    }
    for i in range(config.num_layers):
        m, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = src[m + "self_attention.linear_qkv.weight"].view(g, k + 2, d, h)
        gate, up = src[m + "mlp.linear_fc1.weight"].chunk(2)
        dst.update(
            {
                t + "input_layernorm.weight": src[m + "input_layernorm.weight"],
                t + "post_attention_layernorm.weight": src[m + "pre_mlp_layernorm.weight"],
                t + "self_attn.q_proj.weight": qkv[:, :k].reshape(g * k * d, h),
                t + "self_attn.k_proj.weight": qkv[:, k].reshape(g * d, h),
                t + "self_attn.v_proj.weight": qkv[:, k + 1].reshape(g * d, h),
                t + "self_attn.o_proj.weight": src[m + "self_attention.linear_proj.weight"],
                t + "mlp.gate_proj.weight": gate,
                t + "mlp.up_proj.weight": up,
                t + "mlp.down_proj.weight": src[m + "mlp.linear_fc2.weight"],
            }
        )
    _load(hf, dst)
    return hf


def _load(hf: torch.nn.Module, dst: dict[str, torch.Tensor]) -> None:
    own = hf.state_dict()
    needed = {k for k in own if not k.endswith(("attn.bias", "attn.masked_bias", "lm_head.weight"))}
    if "lm_head.weight" in dst:
        needed.add("lm_head.weight")
    assert needed <= set(dst), f"weights not mapped: {sorted(needed - set(dst))}"
    for key, value in dst.items():
        assert own[key].shape == value.shape, (key, own[key].shape, value.shape)
    hf.load_state_dict(dst, strict=False)


def _compare(family: str, **overrides) -> None:
    config = make_config(
        family, seq_length=SEQ, make_vocab_size_divisible_by=64, init_method_std=0.1, **overrides
    )
    model = GPTModel(config, ParallelState.single()).eval()
    hf = (_gpt2_hf if family == "gpt2" else _llama_hf)(model, config)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, SEQ), generator=g)
    with torch.no_grad():
        logits = model(tokens, None)[..., : config.vocab_size]  # [b, s, V]
        loss = model(tokens, None, labels)  # [b, s]
        hf_logits = hf(input_ids=tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(
        hf_logits.reshape(-1, config.vocab_size), labels.reshape(-1), reduction="none"
    ).view_as(loss)
    assert logits.abs().max() > 0.1  # a model whose logits are ~0 would compare trivially
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=0)


@pytest.mark.kernels_on  # also run with the fused kernels forced on (scripts/test.sh)
def test_gpt2_matches_hf_gpt2_exact_gelu():
    _compare("gpt2")


def test_gpt2_openai_gelu_matches_hf_gelu_new():
    _compare("gpt2", openai_gelu=True)


@pytest.mark.kernels_on
def test_llama_matches_hf_llama_gqa_rope():
    # rotary_base 500000 (Llama 3) so that a base that is ignored shows up
    _compare("llama", rotary_base=500000)


def test_llama_unfused_attention_matches_hf():
    _compare("llama", attention_backend="unfused", use_fused_kernels=False)


def test_a_wrong_convention_is_caught():
    """The comparison can fail: exact GELU in megalite vs HF's tanh approximation."""
    config = make_config("gpt2", seq_length=SEQ, init_method_std=0.1)
    model = GPTModel(config, ParallelState.single()).eval()
    hf = _gpt2_hf(model, dataclasses.replace(config, openai_gelu=True))  # HF with gelu_new
    tokens = torch.randint(
        0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        diff = (model(tokens, None)[..., : config.vocab_size] - hf(input_ids=tokens).logits).abs()
    assert diff.max() > 2e-5
