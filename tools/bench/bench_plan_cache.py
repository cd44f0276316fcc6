"""Block plans shared by a chunk's layers vs built by each layer: a GPT training step with
windowed attention over packed documents (``--reset-attention-mask``: a new mask every
micro-batch, so every forward builds its plans).

    python tools/bench/bench_plan_cache.py [--seq 2048] [--layers 8] [--device cuda]

Shared: one ``PlanCache`` per ``TransformerBlock`` (megalite's build), so a forward builds one
plan list per mask and every layer reuses it, its kernel calls (CPU) or flex ``BlockMask`` (CUDA)
included. Per layer: each layer its own cache (the build before it was shared), so each layer
builds them again. The two models run alternately in the same process, the same weights and data;
printed: median step of each, their ratio, and the plan lists each built per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.data.gpt_dataset import document_attention_mask  # noqa: E402
from megalite.models import GPTConfig  # noqa: E402
from megalite.models.gpt import GPTModel  # noqa: E402
from megalite.models.plan_cache import PlanCache  # noqa: E402


def build(config: GPTConfig, device: torch.device, shared: bool) -> GPTModel:
    """The model, its layers sharing the block's plan cache (``shared``) or each its own."""
    torch.manual_seed(config.seed)
    model = GPTModel(config, ParallelState.single(device), device=device)
    if not shared:
        for layer in model.decoder.layers:
            layer.self_attention.plan_cache = PlanCache()
    return model


def documents(b: int, s: int, mean: int, seed: int) -> torch.Tensor:
    """Document ids # [b, s]: a new document where a coin with 1/``mean`` says so."""
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum((torch.rand(b, s, generator=g) < 1 / mean).long(), dim=1)


def caches(model: GPTModel) -> list[PlanCache]:
    """The model's distinct plan caches."""
    held = {id(c): c for c in (la.self_attention.plan_cache for la in model.decoder.layers)}
    return list(held.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--block", type=int, default=64, help="--attention-block-size")
    p.add_argument("--doc-length", type=int, default=300, help="mean document length")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each, alternating")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tiny", action="store_true", help="a smoke run: small shapes, 1 step")
    args = p.parse_args()
    if args.tiny:
        args.seq, args.layers, args.hidden, args.heads = 64, 2, 32, 2
        args.window, args.block, args.doc_length, args.steps = 16, 8, 20, 1
    device = torch.device(args.device)
    torch.set_num_threads(2)
    config = GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        max_position_embeddings=args.seq,
        vocab_size=1024,
        window_size=(args.window, 0),
        attention_block_size=args.block,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    models = {"shared": build(config, device, True), "per layer": build(config, device, False)}
    assert len(caches(models["shared"])) == 1 and len(caches(models["per layer"])) == args.layers
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (args.batch, args.seq), generator=g).to(device)
    labels = torch.randint(0, 1024, (args.batch, args.seq), generator=g).to(device)

    def step(model: GPTModel, seed: int) -> float:
        mask = document_attention_mask(documents(args.batch, args.seq, args.doc_length, seed))
        mask = mask.to(device)  # a new mask tensor, as each micro-batch brings
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(tokens, None, labels, attention_mask=mask).float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for model in models.values():  # warm-up: allocations, kernels, compilation
        step(model, 0)
    before = {name: sum(c.built for c in caches(model)) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.steps):
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        for name in order:
            times[name].append(step(models[name], i + 1))
    per_step = {
        name: (sum(c.built for c in caches(m)) - before[name]) / args.steps
        for name, m in models.items()
    }
    print(
        f"{args.device}: {args.layers} layers, h {args.hidden}, seq {args.seq}, batch "
        f"{args.batch}, window {args.window}, block {args.block}, documents of ~{args.doc_length} "
        f"tokens, a new mask each step; median of {args.steps} steps, alternating"
    )
    for name in models:
        print(
            f"  {name:9s} {statistics.median(times[name]) * 1e3:8.1f} ms  plan lists built per "
            f"step {per_step[name]:.0f}"
        )
    ratio = statistics.median(times["shared"]) / statistics.median(times["per layer"])
    print(f"  shared / per layer: {ratio:.3f}x")


if __name__ == "__main__":
    main()
