"""GPTConfig: derived defaults, and one-line errors that name the field, the numbers and the fix
(the flag layer rewrites the names into flags: tests/training/test_flag_messages.py)."""

from __future__ import annotations

import re

import pytest

from megalite.models import GPTConfig

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100, seq_length=16)


def test_defaults_resolve_like_megatron():
    c = GPTConfig(**BASE)
    assert (c.max_position_embeddings, c.ffn_hidden_size) == (16, 256)
    assert (c.num_query_groups, c.kv_channels, c.heads_per_group) == (8, 8, 1)
    assert c.padded_vocab_size(1) == 128 and c.padded_vocab_size(4) == 512
    full = GPTConfig(**BASE, recompute_granularity="full", recompute_method="block")
    assert full.recompute_num_layers == 1
    GPTConfig(**BASE, num_query_groups=2).validate(tp_size=2, pp_size=4)  # a valid layout


BAD = [
    # (overrides, tp, pp, the message must contain)
    (
        dict(num_attention_heads=6, hidden_size=60),
        4,
        1,
        "num_attention_heads 6 is not divisible by tp_size 4",
    ),
    (
        dict(num_query_groups=2),
        4,
        1,
        "num_query_groups 2 is not divisible by tp_size 4",
    ),
    (
        dict(num_query_groups=3),
        1,
        1,
        "num_attention_heads 8 is not divisible by num_query_groups 3",
    ),
    (
        dict(ffn_hidden_size=100),
        8,
        1,
        "ffn_hidden_size 100 is not divisible by tp_size 8",
    ),
    (
        dict(sequence_parallel=True, seq_length=18, max_position_embeddings=32),
        4,
        1,
        "seq_length 18 is not divisible by tp_size 4 under sequence_parallel",
    ),
    (dict(), 1, 3, "num_layers 4 is not divisible by pp_size 3"),
    (
        dict(seq_length=32, max_position_embeddings=16),
        1,
        1,
        "seq_length 32 exceeds max_position_embeddings 16",
    ),
    (dict(position_embedding_type="alibi"), 1, 1, "position_embedding_type must be one of"),
    (dict(normalization="BatchNorm"), 1, 1, "normalization must be one of"),
    (dict(attention_backend="flash"), 1, 1, "attention_backend must be one of sdpa, unfused"),
    (
        dict(recompute_granularity="full"),
        1,
        1,
        "recompute_granularity full needs recompute_method",
    ),
    (
        dict(recompute_granularity="selective", recompute_method="block"),
        1,
        1,
        "recompute_method block applies only to recompute_granularity full",
    ),
    (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
        1,
        1,
        "recompute_num_layers must be >= 1",
    ),
    (dict(position_embedding_type="rope", kv_channels=7), 1, 1, "even head dim"),
    (dict(hidden_dropout=1.0), 1, 1, "hidden_dropout must be in [0, 1)"),
]


@pytest.mark.parametrize("overrides,tp,pp,message", BAD)
def test_invalid_layouts_are_refused_in_one_line(overrides, tp, pp, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**BASE, **overrides}).validate(tp_size=tp, pp_size=pp)
    text = str(err.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden_size=60), "hidden_size 60 is not divisible by num_attention_heads 8"),
        (dict(num_layers=0), "num_layers must be an integer >= 1, got 0"),
        (dict(vocab_size=None), "vocab_size must be an integer >= 1, got None"),
    ],
)
def test_impossible_sizes_are_refused_on_construction(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(**{**BASE, **overrides})
