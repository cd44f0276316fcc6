"""The model-FLOPs formula against numbers worked out by hand, and the paper's closed form."""

from __future__ import annotations

import math

from megalite.models.attention_mask import attention_fraction
from megalite.models.config import GPTConfig
from megalite.training.flops import model_flops_per_iteration, peak_tflops, throughput


def test_gpt2_tiny_by_hand():
    # L=2, h=32, 4 heads (q = kv = 32), s=16, f=128, V=128, global batch 8 -> 128 tokens.
    # per token per layer: QKV 2*32*(32+64)=6144, QK^T 2*16*32=1024, AV 1024, proj 2*32*32=2048,
    # MLP 4*32*128=16384 -> 26624; x2 layers = 53248; logits 2*32*128 = 8192 -> 61440 forward;
    # x3 (fwd + bwd) x 128 tokens = 23,592,960.
    got = model_flops_per_iteration(
        num_layers=2,
        hidden_size=32,
        seq_length=16,
        global_batch_size=8,
        padded_vocab_size=128,
        ffn_hidden_size=128,
        num_attention_heads=4,
    )
    assert got == 23_592_960


def test_llama_gqa_swiglu_by_hand():
    # L=2, h=32, 4 heads of 8 (q=32), 2 query groups (kv=16), SwiGLU f=64, s=16, V=128, 128 tokens.
    # QKV 2*32*(32+32)=4096, QK^T 1024, AV 1024, proj 2048, MLP 6*32*64=12288 -> 20480 per layer;
    # x2 = 40960; + logits 8192 = 49152; x3 x 128 = 18,874,368.
    got = model_flops_per_iteration(
        num_layers=2,
        hidden_size=32,
        seq_length=16,
        global_batch_size=8,
        padded_vocab_size=128,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        swiglu=True,
    )
    assert got == 18_874_368


def test_matches_the_megatron_paper_closed_form_for_gpt3():
    # Narayanan et al. 2021, eq. (3): 72 B s L h^2 (1 + s/(6h) + V/(12 L h)), GPT-3 175B.
    b, s, L, h, V = 1536, 2048, 96, 12288, 51200
    paper = 72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    got = model_flops_per_iteration(
        num_layers=L,
        hidden_size=h,
        seq_length=s,
        global_batch_size=b,
        padded_vocab_size=V,
        ffn_hidden_size=4 * h,
        num_attention_heads=96,
    )
    assert math.isclose(got, paper, rel_tol=1e-12)


def test_peak_table_override_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 156.0  # TF32
    assert peak_tflops("NVIDIA GH200 480GB", "bf16") == 989.0
    assert peak_tflops(None, "bf16") is None and peak_tflops("Some CPU", "bf16") is None
    assert peak_tflops(None, "bf16", override=123.0) == 123.0
    per_device, mfu = throughput(1e15, 1.0, world_size=4, peak=989.0)
    assert per_device == 250.0 and math.isclose(mfu, 100 * 250 / 989)
    assert throughput(1e15, 2.0, world_size=1, peak=None) == (500.0, None)


def test_windowed_attention_counts_only_computed_blocks():
    # s=8, blocks of 4, window (3, 0): blocks (0,0), (1,0) (query 4 reads keys 1..3), (1,1)
    # -> 3 x 16 = 48 of 64 entries; with --window-attn-skip-freq 2 layer 2 is full: (0.75 + 1) / 2.
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=8)
    windowed = GPTConfig(**base, window_size=(3, 0), attention_block_size=4)
    assert attention_fraction(windowed) == 0.75
    skipped = GPTConfig(**base, window_size=(3, 0), window_attn_skip_freq=2, attention_block_size=4)
    assert attention_fraction(skipped) == 0.875
    assert attention_fraction(GPTConfig(**base)) == 1.0
    # the tiny GPT-2 by hand with a = 0.75: QK^T and AV 1024 -> 768 each per token per layer:
    # 2 layers x 2 x 256 fewer per token = 1024 fewer; x3 x 128 tokens = 393,216 fewer.
    flops = dict(
        num_layers=2,
        hidden_size=32,
        seq_length=16,
        global_batch_size=8,
        padded_vocab_size=128,
        ffn_hidden_size=128,
        num_attention_heads=4,
    )
    assert model_flops_per_iteration(**flops, attention_fraction=0.75) == 23_592_960 - 393_216
