"""MoE model config: the layer pattern of ``--moe-layer-freq``, and the Mixtral 8x7B script's
parameter count (from the parsed model config and a plain formula, not by building the model)."""

from __future__ import annotations

import pytest

from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern
from megalite.training.arguments import parse_args
from tests.scripts.test_pretrain_scripts import _dry_run, _parameters


def _config(**moe) -> GPTConfig:
    return GPTConfig(
        num_layers=4,
        hidden_size=8,
        num_attention_heads=2,
        vocab_size=16,
        seq_length=4,
        num_experts=4,
        **moe,
    )


@pytest.mark.parametrize(
    "freq, pattern",
    [
        (1, [1, 1, 1, 1]),
        (2, [1, 0, 1, 0]),
        ("[0,1,1,0]", [0, 1, 1, 0]),
        ("([0]+[1]*3)", [0, 1, 1, 1]),
    ],
)
def test_moe_layer_freq(freq, pattern):
    assert moe_layer_pattern(_config(moe_layer_freq=freq)) == [bool(v) for v in pattern]


def test_bad_moe_layer_freq_is_one_line():
    with pytest.raises(ValueError, match="neither an integer nor a list"):
        moe_layer_pattern(_config(moe_layer_freq="[1, x]"))


def moe_parameters(m) -> tuple[int, int]:
    """(total, active per token) parameters of an MoE model: each MoE layer's MLP is replaced by
    ``num_experts`` experts (bias-free) and a router; a token uses ``topk`` experts."""
    dense = _parameters(m)
    f, h = m.moe_ffn_hidden_size or m.ffn_hidden_size, m.hidden_size
    bias = 1 if m.add_bias_linear else 0
    dense_mlp = h * m.ffn_hidden_size * (2 if m.swiglu else 1) + bias * m.ffn_hidden_size
    dense_mlp += m.ffn_hidden_size * h + bias * h
    expert = h * f * (3 if m.swiglu else 2)
    moe_layers = sum(moe_layer_pattern(m))
    base = dense - moe_layers * dense_mlp + moe_layers * m.num_experts * h  # + routers
    return (
        base + moe_layers * m.num_experts * expert,
        base + moe_layers * m.moe_router_topk * expert,
    )


def test_mixtral_8x7b_script_has_its_names_parameter_count(tmp_path):
    argv = _dry_run("scripts/pretrain_gpt_mixtral_8x7b.sh", 32000, tmp_path)
    cfg = parse_args(argv, env={"RANK": "0", "WORLD_SIZE": "64"})
    m, par = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, par.expert_model_parallel_size) == (8, 2, 8)
    total, active = moe_parameters(m)
    # Mixtral-8x7B: 46,702,792,704 parameters, 12.9B active (Mistral AI's figures)
    assert total == 46_702_792_704, total
    assert 12.8e9 < active < 13.0e9, active
