"""The HF converters carry Megatron's math flags where HuggingFace has a field.

``--apply-layernorm-1p`` (norm weights stored as ``w - 1``) exports ``1 + w`` and imports minus 1;
``--use-rope-scaling`` is Llama's ``rope_type "llama3"``; ``--squared-relu`` is GPT-2's ``relu2``.
The exported model's logits equal megalite's (fp32; 1e-4 absolute as the other conversion
tests: the two implementations order their reductions differently), the round trip is exact, and
what HF cannot express is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from megalite.conversion import ConversionError, gpt2, llama, mixtral, qwen2_moe
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.models.helpers import make_config

transformers = pytest.importorskip("transformers")


def _perturbed(config) -> GPTModel:
    model = GPTModel(config, ParallelState.single()).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_folds_1p_and_maps_activation_and_rope_scaling(family):
    if family == "llama":
        config = make_config(
            "llama",
            apply_layernorm_1p=True,
            use_rope_scaling=True,
            rope_scaling_factor=8.0,
            rotary_base=500000,
            seq_length=16,
            make_vocab_size_divisible_by=1,
        )
        module, hf_class = llama, transformers.LlamaForCausalLM
    else:
        config = make_config(
            "gpt2",
            apply_layernorm_1p=True,
            squared_relu=True,
            seq_length=16,
            make_vocab_size_divisible_by=1,
        )
        module, hf_class = gpt2, transformers.GPT2LMHeadModel
    model = _perturbed(config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_state = module.to_hf(state, config)
    norm = "model.norm.weight" if family == "llama" else "transformer.ln_f.weight"
    assert torch.equal(hf_state[norm], state["decoder.final_layernorm.weight"] + 1)
    hf_config = module.hf_config(config, bos_token_id=None, eos_token_id=None)
    hf = hf_class(hf_config).eval()
    hf.load_state_dict(hf_state, strict=False)
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours = model(tokens, None)
        theirs = hf(input_ids=tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    back = module.config_from_hf(hf_config)
    for field in ("squared_relu", "use_rope_scaling", "rope_scaling_factor"):
        assert getattr(back, field) == getattr(config, field), field
    back.apply_layernorm_1p = True  # HF has no such field: the target model says so
    again = module.from_hf(hf_state, back)
    assert set(again) == set(state)
    for k, v in state.items():  # (w + 1) - 1 rounds in fp32: within an ulp of 1
        assert (again[k] - v).abs().max() <= (1e-7 if "layernorm" in k else 0.0), k


def test_what_hf_cannot_express_is_refused():
    for family, kwargs, words in (
        ("llama", dict(qk_layernorm=True), "qk-layernorm"),
        ("llama", dict(rotary_percent=0.5), "rotary-percent"),
        ("llama", dict(rotary_interleaved=True), "rotary-interleaved"),
        ("gpt2", dict(qk_layernorm=True), "qk-layernorm"),
    ):
        module = llama if family == "llama" else gpt2
        with pytest.raises(ConversionError, match=words):
            module.check(make_config(family, **kwargs))
    # Mixtral and Qwen2 exports write plain RoPE: llama3 scaling is refused, not dropped
    scaled = make_config("llama", use_rope_scaling=True)
    for check, model in (
        (mixtral.check, "MixtralForCausalLM"),
        (qwen2_moe.check_dense, "Qwen2ForCausalLM"),
    ):
        with pytest.raises(ConversionError, match=f"{model} needs no --use-rope-scaling"):
            check(scaled)
    llama.check(scaled)  # Llama writes it
    other = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    with pytest.raises(ConversionError, match="linear"):
        llama.config_from_hf(other)
