"""HF Mistral <-> megalite (a transformers model built from a config, offline; fp32).

A random ``MistralForCausalLM`` with ``sliding_window`` 6 imports at TP2 x PP2 as a Llama-family
model with ``window_size`` (5, 0) and exports back to identical tensors and config. On 48 tokens
(8 windows) megalite's logits equal transformers' within 1e-5 of the logits' scale (fp32; the two
differ in op order only), while the same weights with a window one key wider or narrower move
them by far more: the window is converted exactly, not approximately. Models Mistral cannot
express (a window reaching forward, full layers among windowed ones, sparse layouts) and windowed
models of other families are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from megalite import load_model
from megalite.conversion import (
    ConversionError,
    export_to_hf,
    family_of,
    hf_logit_difference,
    import_from_hf,
    megalite_flags,
)
from megalite.conversion.hf_files import load_hf_weights
from megalite.models import GPTConfig
from tools.convert_checkpoint_to_hf import main as to_hf_main

transformers = pytest.importorskip("transformers")

WINDOW = 6  # HF sliding_window: each query reads itself and the 5 keys before it
SEQ = 48


def _random_mistral(path: str, sliding_window: int) -> None:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
    )
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)
    model.eval().save_pretrained(path)


def _with_window(src: str, dst: str, sliding_window: int) -> None:
    """A copy of the HF folder ``src`` whose config has another ``sliding_window``."""
    model = transformers.MistralForCausalLM.from_pretrained(src, local_files_only=True)
    model.config.sliding_window = sliding_window
    model.save_pretrained(dst)


def test_mistral_round_trip_is_identical_and_logits_match_past_the_window(tmp_path):
    hf_dir, ml, back = str(tmp_path / "hf"), str(tmp_path / "ml"), str(tmp_path / "back")
    _random_mistral(hf_dir, WINDOW)
    config, _ = import_from_hf(hf_dir, ml, tp_size=2, pp_size=2)
    assert config.window_size == (WINDOW - 1, 0) and config.window_attn_skip_freq is None
    assert family_of(config) == "mistral"
    assert megalite_flags(config)[-4:] == [
        "--window-size",
        f"{WINDOW - 1},0",
        "--attention-dropout",
        "0",
    ]

    export_to_hf(ml, back)
    before, after = load_hf_weights(hf_dir), load_hf_weights(back)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    written = json.load(open(tmp_path / "back" / "config.json"))
    assert written["architectures"] == ["MistralForCausalLM"]
    assert written["model_type"] == "mistral" and written["sliding_window"] == WINDOW

    model = load_model(ml)
    tokens = torch.randint(0, 101, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scale = float(model(tokens).abs().max())
    assert scale > 1.0  # logits of a real size, so 1e-5 of them is a real bar
    assert hf_logit_difference(hf_dir, model, seq_length=SEQ) <= 1e-5 * scale
    assert hf_logit_difference(back, model, seq_length=SEQ) <= 1e-5 * scale
    for other in (WINDOW - 1, WINDOW + 1):  # one key off: the bar above catches it
        moved = str(tmp_path / f"hf_{other}")
        _with_window(hf_dir, moved, other)
        assert hf_logit_difference(moved, model, seq_length=SEQ) > 1e-2 * scale, other
    assert to_hf_main(["--load", ml, "--save", str(tmp_path / "verified"), "--verify"]) == 0


def _llama(**kw) -> GPTConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    llama = dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    return GPTConfig(**base, **llama, **kw)


def test_what_mistral_cannot_express_is_refused():
    assert family_of(_llama()) == "llama"
    assert family_of(_llama(window_size=(7, 0))) == "mistral"
    assert family_of(_llama(window_size=(7, 0), window_attn_skip_freq="[1,1,1,1]")) == "mistral"
    with pytest.raises(ConversionError, match=r"MistralForCausalLM needs --window-size LEFT,0"):
        family_of(_llama(window_size=(7, 2)))
    with pytest.raises(ConversionError, match=r"windows every layer.* leaves layers \[1, 3\] full"):
        family_of(_llama(window_size=(7, 0), window_attn_skip_freq=2))
    with pytest.raises(ConversionError, match="MistralForCausalLM needs no --sparse-attention"):
        family_of(_llama(window_size=(7, 0), sparse_attention="fixed"))
    with pytest.raises(ConversionError, match="LlamaForCausalLM needs no --sparse-attention"):
        family_of(_llama(sparse_attention="bigbird"))
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    with pytest.raises(ConversionError, match="MixtralForCausalLM needs no --window-size"):
        family_of(_llama(window_size=(7, 0), **moe))
    gpt2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    with pytest.raises(ConversionError, match="GPT2LMHeadModel needs no --window-size"):
        family_of(GPTConfig(**gpt2, window_size=(3, 0)))
