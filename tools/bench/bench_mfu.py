"""Model FLOPs utilisation of one training step on one GPU: megalite vs plain PyTorch vs compile.

    python tools/bench/bench_mfu.py [--models gpt2-1.3b llama-1b] [--steps 10] [--out FILE]
    python tools/bench/bench_mfu.py --device cpu --tiny     # seconds-long smoke run of the code

Models (``--seq 2048``): GPT-2 1.3B-shaped (24 layers, hidden 2048, 16 heads, learned positions,
LayerNorm, GELU, biases, tied embeddings, vocab 50257) and Llama-style 1B (16 layers, hidden
2048, FFN 8192, 32 heads in 8 query groups, RoPE, RMSNorm, SwiGLU, no biases, vocab 128256).
Each is timed three ways in the same process, bf16 parameters and activations, one step =
zero_grad + forward + mean token loss + backward + ``torch.optim.AdamW.step()`` (fused on CUDA):

- megalite:  ``GPTModel`` (TP1/PP1, fused kernels on, SDPA attention)
- plain:     the same architecture written with nn.Linear / F.scaled_dot_product_attention
- compile:   ``torch.compile`` of the plain model

For each, the largest micro-batch that fits is found by trying ``--micro-batches`` in descending
order (an out-of-memory step moves to the next). Reported: micro-batch, step time (median),
tokens/s, TFLOP/s and MFU from ``megalite.training.flops`` (the formula megalite logs: model
FLOPs, no recomputation, causal mask not discounted), peak ``torch.cuda.max_memory_allocated``;
then the ratio megalite / plain and megalite / compile in tokens/s. Without CUDA (and without
``--device cpu``) it prints one line and exits 0. On CPU there is no peak TFLOP/s: MFU is "-".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.training.flops import model_flops_per_iteration, peak_tflops  # noqa: E402
from tools.bench.bench_gpt_step import PlainGPT  # noqa: E402

GIB = 2**30
MODELS = {
    "gpt2-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257),
    "llama-1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=64,
        ffn_hidden_size=8192,
        vocab_size=128256,
        position_embedding_type="rope",
        rotary_base=500000,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
    ),
}
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512)


def gpt_config(name: str, seq: int, tiny: bool) -> GPTConfig:
    shape = dict(MODELS[name])
    if tiny:
        shape.update(TINY)
        if name == "llama-1b":
            shape.update(num_query_groups=2, kv_channels=16, ffn_hidden_size=128)
    return GPTConfig(
        **shape,
        seq_length=seq,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
    )


class PlainRMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: # [b, n, s, d]; rotate-half RoPE (HF Llama layout)."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class PlainLlamaBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        h, d = c.hidden_size, c.kv_channels
        self.heads, self.groups, self.d = c.num_attention_heads, c.num_query_groups, d
        self.norm_1 = PlainRMSNorm(h, c.norm_epsilon)
        self.norm_2 = PlainRMSNorm(h, c.norm_epsilon)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.groups) * d, bias=False)
        self.proj = nn.Linear(self.heads * d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * c.ffn_hidden_size, bias=False)
        self.down = nn.Linear(c.ffn_hidden_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm_1(x))
        q, k, v = qkv.split([self.heads * self.d, self.groups * self.d, self.groups * self.d], -1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm_2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(PlainLlamaBlock(c) for _ in range(c.num_layers))
        self.norm_f = PlainRMSNorm(c.hidden_size, c.norm_epsilon)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        d = c.kv_channels
        inv = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(c.seq_length).float(), inv)
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=c.init_method_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(kind: str, name: str, config: GPTConfig, device: torch.device) -> nn.Module:
    if kind == "megalite":
        tracker = model_parallel_seed(config.seed, tp_rank=0, pp_rank=0)
        return GPTModel(config, ParallelState.single(), rng_tracker=tracker, device=device)
    torch.manual_seed(config.seed)
    plain = (PlainLlama if name == "llama-1b" else PlainGPT)(config)
    plain = plain.to(device=device, dtype=torch.bfloat16)
    return torch.compile(plain) if kind == "compile" else plain


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    kind: str, name: str, config: GPTConfig, device: torch.device, mbs: int, steps: int
) -> float:
    """Median seconds of one training step at micro-batch ``mbs`` (raises on OOM)."""
    model = build(kind, name, config, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    shape = (mbs, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, device=device, generator=g)
    labels = torch.randint(0, config.vocab_size, shape, device=device, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if kind == "megalite":
            loss = model(tokens, None, labels).float().mean()
        else:
            loss = model(tokens, labels)
        loss.backward()
        opt.step()

    for _ in range(2):  # warm-up: allocator, AdamW state, compilation
        step()
    sync(device)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def best_fit(
    kind: str, name: str, config: GPTConfig, device: torch.device, sizes: list[int], steps: int
) -> dict | None:
    """The first micro-batch of ``sizes`` (descending) whose step fits, with its figures."""
    for mbs in sorted(sizes, reverse=True):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds = measure(kind, name, config, device, mbs, steps)
        except torch.OutOfMemoryError:
            seconds = None
        if device.type == "cuda":  # the model, its grads and AdamW state are gone with measure
            torch.cuda.empty_cache()
        if seconds is None:
            continue
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        return {"mbs": mbs, "seconds": seconds, "peak_gib": peak}
    return None


def figures(result: dict, config: GPTConfig, peak_device: float | None) -> dict:
    flops = model_flops_per_iteration(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        seq_length=config.seq_length,
        global_batch_size=result["mbs"],
        padded_vocab_size=config.padded_vocab_size(1),
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.kv_channels,
        num_query_groups=config.num_query_groups,
        swiglu=config.swiglu,
    )
    tflops = flops / result["seconds"] / 1e12
    return {
        **result,
        "tokens_s": result["mbs"] * config.seq_length / result["seconds"],
        "tflops": tflops,
        "mfu": 100.0 * tflops / peak_device if peak_device else None,
    }


def fmt_row(name: str, kind: str, r: dict | None) -> str:
    if r is None:
        return f"| {name} | {kind} | no micro-batch fits | | | | | |"
    mfu = f"{r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
    return (
        f"| {name} | {kind} | {r['mbs']} | {r['seconds'] * 1e3:.1f} | {r['tokens_s']:,.0f} | "
        f"{r['tflops']:.1f} | {mfu} | {peak} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--kinds", nargs="+", default=["megalite", "plain", "compile"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[16, 12, 8, 6, 4, 2, 1])
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is shown")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke test of the code)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if args.tiny:  # sequence 128, one micro-batch size, two steps; on CPU no torch.compile
        args.seq, args.micro_batches, args.steps = 128, [2], 2
        if args.device == "cpu":
            args.kinds = [k for k in args.kinds if k != "compile"]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_mfu.py: no CUDA GPU (torch.cuda.is_available() is False), nothing measured")
        return 0
    device = torch.device(args.device)
    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_device = peak_tflops(name_of_device if device.type == "cuda" else None, "bf16")
    lines = [
        f"device: {name_of_device}, bf16, seq {args.seq}, peak {peak_device or '-'} TFLOP/s"
        + (" (tiny models)" if args.tiny else ""),
        "| model | impl | micro-batch | step ms | tokens/s | TFLOP/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    ratios = []
    for name in args.models:
        config = gpt_config(name, args.seq, args.tiny)
        results = {}
        for kind in args.kinds:
            fit = best_fit(kind, name, config, device, args.micro_batches, args.steps)
            results[kind] = figures(fit, config, peak_device) if fit else None
            lines.append(fmt_row(name, kind, results[kind]))
            print(lines[-1], flush=True)
        mine = results.get("megalite")
        for other in ("plain", "compile"):
            if mine and results.get(other):
                ratios.append(
                    f"{name}: megalite / {other} tokens/s = "
                    f"{mine['tokens_s'] / results[other]['tokens_s']:.2f}x"
                )
    print("\n".join(ratios))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines + [""] + ratios) + "\n")
    failed = any(line.endswith("no micro-batch fits | | | | | |") for line in lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
