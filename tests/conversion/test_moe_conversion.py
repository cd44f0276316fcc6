"""HF Mixtral <-> megalite (transformers model built from a config, offline; fp32).

HF -> megalite at TP2 x PP2 (experts written by global index) -> HF gives identical tensors; the
imported checkpoint computes the HF model's logits within 1e-4 (``hf_logit_difference``; measured
~1e-7, op order only, while a misrouted expert moves logits of size ~0.5 by far more), and
``tools/convert_checkpoint_to_hf.py --verify`` passes on it.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from megalite import load_model
from megalite.conversion import export_to_hf, hf_logit_difference, import_from_hf
from megalite.conversion.hf_files import load_hf_weights
from tools.convert_checkpoint_to_hf import main as to_hf_main


def _random_mixtral(path: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():  # make sure the experts and the router are not trivially zero
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    return model


@pytest.mark.kernels_on  # also run with the fused kernels forced on (scripts/test.sh)
def test_mixtral_round_trip_is_identical_and_logits_match(tmp_path):
    hf_dir, ml, back = str(tmp_path / "hf"), str(tmp_path / "ml"), str(tmp_path / "back")
    _random_mixtral(hf_dir)
    config, iter_dir = import_from_hf(hf_dir, ml, tp_size=2, pp_size=2)
    assert config.num_experts == 4 and config.moe_router_topk == 2
    assert "experts" in os.listdir(iter_dir)
    export_to_hf(ml, back)
    before, after = load_hf_weights(hf_dir), load_hf_weights(back)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    model = load_model(ml)
    tokens = torch.arange(32).view(2, 16) * 3 % 101
    with torch.no_grad():
        assert model(tokens).abs().max() > 0.05  # not trivially ~0
    assert hf_logit_difference(hf_dir, model) < 1e-4
    assert to_hf_main(["--load", ml, "--save", str(tmp_path / "verified"), "--verify"]) == 0
