"""megalite's own GPT (``GPTModel``, one process) and the same network assembled from the 3D layers
at TP 8 (q = 2), holding blocks of the GPT's parameters, give the same loss and grads: GPT-2 and
Llama (GQA, SwiGLU, RoPE through ``megalite.models.rotary``), untied output layer.

The 3D assembly names its modules as ``GPTModel`` does, so each parameter's block is cut from the
parameter of the same name (``block_of_named``, chunk only): the mapping a checkpoint reshard
between 1D and 3D needs. Norm weights and biases are perturbed from their init (ones, zeros) so
every path shows. Tolerance: norm-wise relative error 1e-5 per tensor (``tests/models``' bar).
Also: the bytes each rank sends in the step, counted at the collectives by the op recorder, equal
the sum of ``cost3d.py``'s closed forms; the grad norm with each replicated parameter counted once
(``Groups3D.holds_first_copy``) equals the one-process grad norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.core.op_record import RECORDER
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel import reduce_from_tp_region
from megalite.core.tensor_parallel.init import keyed_generator
from megalite.core.tensor_parallel.modes.block3d import MLP3D, SelfAttention3D
from megalite.core.tensor_parallel.modes.cost3d import (
    block3d_bytes,
    cross_entropy3d_bytes,
    embedding3d_bytes,
    linear3d_bytes,
    norm3d_bytes,
    position3d_bytes,
)
from megalite.core.tensor_parallel.modes.grid3d import Groups3D
from megalite.core.tensor_parallel.modes.layers3d import LayerNorm3D, Linear3D, RMSNorm3D
from megalite.core.tensor_parallel.modes.vocab3d import (
    PositionEmbedding3D,
    VocabEmbedding3D,
    cross_entropy_3d,
)
from megalite.models import GPTConfig, GPTModel
from megalite.models.rotary import apply_rotary, rotary_cos_sin
from tests.core.tensor_parallel.test_modes_3d_layers import (
    groups3d,
    record,
    sent_bytes,
    weight_block,
)
from tests.harness import run_distributed
from tests.models.helpers import make_batch, make_config, rel_err

TOL = 1e-5
BATCH = 4  # divisible by q^2


class _Embedding3D(nn.Module):
    def __init__(self, c: GPTConfig, g: Groups3D):
        super().__init__()
        self.word_embeddings = VocabEmbedding3D(c.padded_vocab_size(1), c.hidden_size, g)
        self.position_embeddings = None
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = PositionEmbedding3D(
                c.max_position_embeddings, c.hidden_size, g
            )

    def forward(self, tokens_sb: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens_sb)  # [s, b/q^2, h/q], residual layout
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(tokens_sb.shape[0])
        return x


class _Layer3D(nn.Module):
    def __init__(self, c: GPTConfig, g: Groups3D, rotary):
        super().__init__()
        norm = RMSNorm3D if c.normalization == "RMSNorm" else LayerNorm3D
        self.input_layernorm = norm(c.hidden_size, g, eps=c.norm_epsilon)
        self.self_attention = SelfAttention3D(
            c.hidden_size,
            c.num_attention_heads,
            g,
            num_query_groups=c.num_query_groups,
            bias=c.add_bias_linear,
            rotary=rotary,
        )
        self.pre_mlp_layernorm = norm(c.hidden_size, g, eps=c.norm_epsilon)
        self.mlp = MLP3D(
            c.hidden_size, c.ffn_hidden_size, g, swiglu=c.swiglu, bias=c.add_bias_linear
        )

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder3D(nn.Module):
    def __init__(self, c: GPTConfig, g: Groups3D, rotary):
        super().__init__()
        self.layers = nn.ModuleList(_Layer3D(c, g, rotary) for _ in range(c.num_layers))
        norm = RMSNorm3D if c.normalization == "RMSNorm" else LayerNorm3D
        self.final_layernorm = norm(c.hidden_size, g, eps=c.norm_epsilon)


class GPT3D(nn.Module):
    """The 3D network under ``GPTModel``'s parameter names; ``forward`` gives the masked mean
    loss, the same on every rank."""

    def __init__(self, c: GPTConfig, g: Groups3D):
        super().__init__()
        self.config, self.g = c, g
        rotary = None
        if c.position_embedding_type == "rope":
            cos, sin = rotary_cos_sin(
                torch.arange(c.seq_length)[None],
                head_dim=c.kv_channels,
                base=c.rotary_base,
                dtype=torch.float32,
            )
            rotary = lambda q, k: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
        self.embedding = _Embedding3D(c, g)
        self.decoder = _Decoder3D(c, g, rotary)
        self.output_layer = Linear3D(c.hidden_size, c.padded_vocab_size(1), g, bias=False)

    def forward(self, tokens, labels, weights) -> torch.Tensor:
        x = self.embedding(tokens.t())
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.output_layer(self.decoder.final_layernorm(x))  # inner layout
        mask = weights.t()
        losses = cross_entropy_3d(
            logits, labels.t(), self.g, vocab_size=self.config.vocab_size, loss_mask=mask
        )
        total = reduce_from_tp_region(losses.sum(), self.g.output_group)
        return reduce_from_tp_region(total, self.g.weight_group) / mask.sum()


def block_of_named(name: str, full: torch.Tensor, g: Groups3D, c: GPTConfig) -> torch.Tensor:
    """This rank's block of ``GPTModel`` parameter ``name`` (value or grad ``full``), by chunk."""
    q = g.q
    if name.endswith("word_embeddings.weight"):  # vocab block input, hidden (output, weight)
        return full.chunk(q)[g.input_rank].chunk(q * q, dim=1)[g.output_rank * q + g.weight_rank]
    if name.endswith("position_embeddings.weight"):
        return full.chunk(q, dim=1)[g.output_rank]
    if "layernorm" in name:
        return full.chunk(q)[g.output_rank]
    if "linear_proj" in name or "linear_fc2" in name:
        return weight_block(full, g, "inner")
    stride = 2 if "linear_fc1" in name and c.swiglu else 1  # qkv, fc1, output layer
    return weight_block(full, g, "residual", stride=stride)


def _model_bytes(c: GPTConfig, q: int) -> float:
    """``cost3d.py``'s closed forms summed over the model, and the loss's two all-reduces of one
    element (the sum over the batch blocks)."""
    m, h, v = c.seq_length * BATCH, c.hidden_size, c.padded_vocab_size(1)
    rms = c.normalization == "RMSNorm"
    qkv = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
    kinds = dict(qkv_size=qkv, bias=c.add_bias_linear, swiglu=c.swiglu, rms=rms)
    learned = c.position_embedding_type == "learned_absolute"
    return (
        embedding3d_bytes(m, v, h, q)
        + (position3d_bytes(c.seq_length, h, q) if learned else 0)
        + c.num_layers * block3d_bytes(m, h, c.ffn_hidden_size, q, **kinds)
        + norm3d_bytes(m, h, q, rms=rms)
        + linear3d_bytes(m, h, v, q, bias=False)
        + cross_entropy3d_bytes(m, q)
        + 2 * 2 * (q - 1) / q * 4
    )


def _model_cases(q: int):
    g = groups3d(q) if q > 1 else Groups3D.single()
    for family in ("gpt2", "llama"):
        c = make_config(family, untie_embeddings_and_output_weights=True)
        oracle = GPTModel(c, ParallelState.single())
        with torch.no_grad():
            for name, p in oracle.named_parameters():
                if "layernorm" in name or name.endswith("bias"):
                    p.add_(0.2 * torch.randn(p.shape, generator=keyed_generator(5, name)))
        tokens, labels, weights = make_batch(c, batch=BATCH)
        ref = (oracle(tokens, None, labels) * weights).sum() / weights.sum()
        ref.backward()

        model = GPT3D(c, g)
        full = dict(oracle.named_parameters())
        assert sorted(n for n, _ in model.named_parameters()) == sorted(full)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(block_of_named(name, full[name].detach(), g, c))
        record()
        loss = model(tokens, labels, weights)
        loss.backward()
        sent, expected = sent_bytes(), _model_bytes(c, q)
        RECORDER.disable()
        assert sent == pytest.approx(expected, rel=1e-12), ("bytes", family, sent, expected)
        assert rel_err(loss, ref.detach()) < TOL, (family, loss.item(), ref.item())
        for name, p in model.named_parameters():
            expected = block_of_named(name, full[name].grad, g, c)
            assert rel_err(p.grad, expected) < TOL, (family, name, rel_err(p.grad, expected))
        # the grad norm, each parameter counted on the first of its copies only
        sq = sum(p.grad.pow(2).sum() for p in model.parameters() if g.holds_first_copy(p))
        if q > 1:
            dist.all_reduce(sq)  # the world is the TP group
        ref_sq = sum(p.grad.pow(2).sum() for p in oracle.parameters())
        assert rel_err(sq, ref_sq) < TOL, ("grad norm", family)
    return True


def test_gpt_model_equals_3d_assembly_at_tp8():
    assert run_distributed(_model_cases, 8, 2) == [True] * 8


def test_gpt_model_equals_3d_assembly_in_one_process():
    assert _model_cases(1)
