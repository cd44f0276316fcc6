"""HF Qwen2-MoE and Qwen2 <-> megalite (transformers models built from a config, offline; fp32).

Qwen2-MoE exercises what Mixtral does not: q/k/v biases (``--add-qkv-bias``), the shared expert
with its sigmoid gate, ``norm_topk_prob`` False (``--moe-router-pre-softmax``) and a dense layer
among MoE layers (``mlp_only_layers`` -> a ``--moe-layer-freq`` list). HF -> megalite at TP2 x
PP2 -> HF gives identical tensors; the imported model's logits are within 1e-4 of HF's (every
weight, biases included, is drawn large enough that a wrong mapping moves them far more), and
``tools/convert_checkpoint_to_hf.py --verify`` passes.
"""

from __future__ import annotations

import torch
import transformers

from megalite import load_model
from megalite.conversion import export_to_hf, hf_logit_difference, import_from_hf
from megalite.conversion.hf_files import load_hf_weights
from tools.convert_checkpoint_to_hf import main as to_hf_main


def _save_random(model: torch.nn.Module, path: str) -> None:
    with torch.no_grad():  # nothing trivially zero (HF zero-inits biases and the router)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2 if (".mlp." in name or "bias" in name) else 0.05)
    model.eval().save_pretrained(path)


def _round_trip(tmp_path, hf_dir: str, **import_kwargs):
    ml, back = str(tmp_path / "ml"), str(tmp_path / "back")
    config, _ = import_from_hf(hf_dir, ml, **import_kwargs)
    export_to_hf(ml, back)
    before, after = load_hf_weights(hf_dir), load_hf_weights(back)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    model = load_model(ml)
    assert hf_logit_difference(hf_dir, model) < 1e-4
    assert hf_logit_difference(back, model) < 1e-4
    assert to_hf_main(["--load", ml, "--save", str(tmp_path / "verified"), "--verify"]) == 0
    return config, model


def test_qwen2_moe_round_trip_is_identical_and_logits_match(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=56,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf_dir = str(tmp_path / "hf")
    _save_random(transformers.Qwen2MoeForCausalLM(cfg), hf_dir)
    config, model = _round_trip(tmp_path, hf_dir, tp_size=2, pp_size=2)
    assert config.add_qkv_bias and config.moe_router_pre_softmax and config.moe_shared_expert_gate
    assert config.moe_layer_freq == "[1,1,0,1]" and config.rotary_base == 1000000
    layer = model.decoder.layers[0].mlp
    assert (
        layer.shared_experts_gate is not None
        and model.decoder.layers[2].mlp.__class__.__name__ == "MLP"
    )
    assert model.decoder.layers[0].self_attention.linear_qkv.bias.abs().max() > 0.1


def test_qwen2_moe_normalised_topk_and_sparse_step(tmp_path):
    """norm_topk_prob True (megalite's default softmax over the chosen logits), tied embeddings,
    decoder_sparse_step 2 (layers 1, 3 MoE)."""
    torch.manual_seed(1)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        tie_word_embeddings=True,
    )
    hf_dir = str(tmp_path / "hf")
    _save_random(transformers.Qwen2MoeForCausalLM(cfg), hf_dir)
    config, _ = _round_trip(tmp_path, hf_dir, tp_size=2)
    assert config.moe_layer_freq == "[0,1,0,1]" and not config.moe_router_pre_softmax


def test_qwen2_dense_round_trip(tmp_path):
    torch.manual_seed(2)
    cfg = transformers.Qwen2Config(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    hf_dir = str(tmp_path / "hf")
    _save_random(transformers.Qwen2ForCausalLM(cfg), hf_dir)
    config, _ = _round_trip(tmp_path, hf_dir, tp_size=2)
    assert config.add_qkv_bias and config.num_experts is None
