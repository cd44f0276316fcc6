"""Tiny model configurations, batches and the oracle-slicing rules the model tests share.

The slicing rules are written from the documented layouts (DESIGN §5), not from the layers' own
partition attributes, so a layer that shards the wrong rows fails the comparison.
"""

from __future__ import annotations

import torch

from megalite.models import GPTConfig

VOCAB = 100
SEQ = 8
BATCH = 2

# GPT-2 family: learned positions, LayerNorm, exact GELU, biases, tied embeddings.
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ)
# Llama family: RoPE, RMSNorm, SwiGLU, GQA (8 heads in 4 groups: 2 query heads per group), no
# biases, untied output layer; ffn not 4h so the explicit size is exercised.
LLAMA = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=96,
    vocab_size=VOCAB,
    seq_length=SEQ,
    position_embedding_type="rope",
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
FAMILIES = {"gpt2": GPT2, "llama": LLAMA}


def make_config(family: str, **overrides) -> GPTConfig:
    kwargs = dict(FAMILIES[family], hidden_dropout=0.0, attention_dropout=0.0)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def make_batch(
    config: GPTConfig, *, seed: int = 0, batch: int = BATCH
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, labels # [b, s] int64 and per-token loss weights # [b, s] (random, so every
    position's gradient path is weighted differently), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    s = config.seq_length
    tokens = torch.randint(0, config.vocab_size, (batch, s), generator=g)
    labels = torch.randint(0, config.vocab_size, (batch, s), generator=g)
    weights = torch.rand(batch, s, generator=g) + 0.5
    return tokens, labels, weights


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ``|a - b| / |b|`` (in fp64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def shard_of_full(
    name: str, full: torch.Tensor, config: GPTConfig, *, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """The part of the unsharded (oracle) tensor ``name`` that TP rank ``tp_rank`` holds."""
    pad_to = config.padded_vocab_size(tp_size)
    leaf = name.rsplit(".", 2)[-2:]
    module, kind = leaf[0], leaf[1]
    if module in ("word_embeddings", "output_layer"):  # vocabulary rows, padded differently
        padded = torch.zeros(pad_to, *full.shape[1:], dtype=full.dtype)
        padded[: config.vocab_size] = full[: config.vocab_size]
        return padded.chunk(tp_size, 0)[tp_rank]
    if module == "linear_qkv":  # groups [q_1..q_k, k, v] concatenated: each rank gets whole groups
        g = config.num_query_groups
        grouped = full.reshape(g, -1, *full.shape[1:])
        return grouped.chunk(tp_size, 0)[tp_rank].reshape(-1, *full.shape[1:])
    if module == "linear_fc1":
        if config.swiglu:  # [gate; up]: each rank holds its rows of both halves
            gate, up = full.chunk(2, 0)
            return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
        return full.chunk(tp_size, 0)[tp_rank]
    if module in ("linear_proj", "linear_fc2") and kind == "weight":  # split input columns
        return full.chunk(tp_size, 1)[tp_rank]
    return full  # norms, row-parallel biases, position embeddings: replicated


def weighted_lm_step(data_iterator, model):
    """The forward step the pipeline tests give a schedule: (tokens, labels, loss weights) batches,
    the loss a weighted mean of the per-token losses."""
    tokens, labels, weights = next(data_iterator)
    out = model(tokens, None, labels)

    def loss_func(per_token):
        loss = (per_token * weights).sum() / weights.sum()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func
