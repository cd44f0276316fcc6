"""One GPT training step at TP1/DP1: megalite's GPTModel vs the same architecture in plain PyTorch.

    python tools/bench/bench_gpt_step.py [--rounds 7] [--steps 3] [--dropout 0.1]
    python tools/bench/bench_gpt_step.py --tiny     # seconds: 2 layers of h 64, one round

Both models are GPT-2 (learned positions, pre-LayerNorm, exact GELU MLP of 4h, biases, tied
embeddings) of the same size, and a step is zero_grad + forward + mean token loss + backward +
``torch.optim.AdamW.step()``, fp32 on CPU. The plain model (``PlainGPT``) is written with
``nn.Linear``, ``nn.LayerNorm``, ``F.scaled_dot_product_attention`` and ``F.cross_entropy`` in
``[b, s, h]`` layout; its fused QKV rows are per head ``[q_i, k_i, v_i]`` (megalite's per-group
layout with one head per group) so a column split keeps whole heads (used by bench_gpt_tp.py).

A third timing, ``megalite-loop``, is the same model through megalite's whole training step
(``Trainer.step`` from ``pretrain.build_run``: the grad buffer with its accumulate hooks, the
schedule's ``no_sync``, the mixed-precision AdamW family with clipping and weight-decay groups,
the LR schedule), fed the same batch: the overhead of the training machinery itself.

Time: the models alternate in one process, ``--rounds`` rounds of ``--steps`` steps each; the
median step time of each is reported (alternating cancels most of this shared machine's drift).

Memory: each model runs in a fresh subprocess; peak memory = peak RSS (``VmHWM``) minus the RSS
measured before the model is built (after torch's lazily loaded modules are in). It counts
parameters, grads, AdamW state and the step's activations (whatever the CPU allocator held at its
peak), not torch itself. Median of ``--mem-runs`` subprocesses. Also printed: the bytes autograd
saves for backward in one step (distinct storages, parameters excluded), which is exact and
noise-free. Targets: time ratio <= 1.10, memory ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.training.arguments import parse_args  # noqa: E402
from megalite.training.config import with_tokenizer  # noqa: E402
from megalite.training.forward_step import make_forward_step  # noqa: E402
from megalite.training.pretrain import build_run  # noqa: E402

SIZE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=8192, seq_length=256)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32)
BATCH = 4
MIB = 2**20


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = h // heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)  # rows per head: [q_i, k_i, v_i]
        self.proj = nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds heads/tp of them
        qkv = self.qkv(self.ln_1(x)).view(b, s, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # [b, n, s, d]
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, -1)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln_2(x)))))


class PlainGPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        h = c.hidden_size
        self.wte = nn.Embedding(c.vocab_size, h)
        self.wpe = nn.Embedding(c.max_position_embeddings, h)
        self.drop = nn.Dropout(c.hidden_dropout)
        self.blocks = nn.ModuleList(
            PlainBlock(h, c.num_attention_heads, c.ffn_hidden_size, c.hidden_dropout)
            for _ in range(c.num_layers)
        )
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, c.vocab_size, bias=False)
        if not c.untie_embeddings_and_output_weights:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=c.init_method_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=c.init_method_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def bench_config(dropout: float, **overrides) -> GPTConfig:
    return GPTConfig(
        **{**SIZE, **overrides},
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_fused_kernels=False,
    )


def build(kind: str, config: GPTConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind == "megalite":
        ps = ParallelState.single()
        tracker = model_parallel_seed(config.seed, tp_rank=0, pp_rank=0)
        model = GPTModel(config, ps, rng_tracker=tracker)
    else:
        torch.manual_seed(config.seed)
        model = PlainGPT(config)
    return model.train(), torch.optim.AdamW(model.parameters(), lr=1e-4)


def make_step(kind: str, model: nn.Module, opt: torch.optim.Optimizer, config: GPTConfig):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)
    labels = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "megalite":
            loss = model(tokens, None, labels).mean()
        else:
            loss = model(tokens, labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def loop_step(config: GPTConfig):
    """``Trainer.step`` of a run built by ``build_run`` for the same model, on the same batch."""
    flags = (
        f"--num-layers {config.num_layers} --hidden-size {config.hidden_size} "
        f"--num-attention-heads {config.num_attention_heads} --seq-length {config.seq_length} "
        f"--micro-batch-size {BATCH} --global-batch-size {BATCH} --train-iters 1000000 "
        f"--lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
        f"--vocab-size {config.vocab_size - 1} "
        f"--hidden-dropout {config.hidden_dropout} --attention-dropout {config.attention_dropout} "
        "--no-fused-kernels --clip-grad 0 --log-interval 1000000 --eval-iters 0"
    ).split()
    cfg = with_tokenizer(parse_args(flags, env={}))
    run = build_run(cfg, ParallelState.single(), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)
    batch = {
        "tokens": tokens,
        "labels": torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g),
        "loss_mask": torch.ones(BATCH, config.seq_length),
        "position_ids": torch.arange(config.seq_length).expand(BATCH, -1),
    }
    data, forward = itertools.repeat(batch), make_forward_step(torch.device("cpu"))

    def step() -> float:
        return float(run.trainer.step(forward, data).losses["lm loss"])

    return step


def time_both(config: GPTConfig, rounds: int, steps: int, warmup: int = 2) -> dict[str, float]:
    steps_of = {k: make_step(k, *build(k, config), config) for k in ("megalite", "plain")}
    steps_of["megalite-loop"] = loop_step(config)
    for step in steps_of.values():  # warm up (allocator, AdamW state)
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {k: [] for k in steps_of}
    for _ in range(rounds):
        for kind, step in steps_of.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                samples[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its high-water mark (``VmHWM``; unlike
    ``ru_maxrss`` it does not inherit the forking parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward in one forward, parameters
    excluded: the activation memory a step holds at the end of forward (deterministic)."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def load_lazy_modules() -> None:
    """Touch what torch loads on first use (AdamW pulls in ~140 MiB of modules on construction;
    attention kernels), so the RSS baseline taken afterwards excludes it for both models."""
    x = torch.randn(1, 1, 8, 8, requires_grad=True)
    opt = torch.optim.AdamW([x])
    F.scaled_dot_product_attention(x, x, x, dropout_p=0.5, is_causal=True).sum().backward()
    opt.step()


def memory_child(kind: str, dropout: float, steps: int, size: dict) -> None:
    """Run in a fresh process: print peak RSS growth over the baseline (after torch's lazy
    modules are loaded, before the model is built) and the saved activation bytes, in bytes."""
    config = bench_config(dropout, **size)
    load_lazy_modules()
    base = rss_bytes()
    model, opt = build(kind, config)
    step = make_step(kind, model, opt, config)
    for _ in range(steps - 1):
        step()
    saved = SavedActivations(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        step()
    peak = rss_bytes("VmHWM")
    print(json.dumps({"peak_delta": peak - base, "saved": saved.nbytes}))


def memory(
    kind: str, dropout: float, steps: int, runs: int, threads: int, tiny: bool
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--memory-child", kind, "--dropout", str(dropout)]
    cmd += ["--steps", str(steps), "--threads", str(threads), *(["--tiny"] if tiny else [])]
    out = [
        json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        for _ in range(runs)
    ]
    return {key: statistics.median(o[key] for o in out) for key in out[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--mem-runs", type=int, default=3)
    parser.add_argument("--memory-child", choices=["megalite", "plain"])
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 2 layers of h 64")
    args = parser.parse_args()
    size = TINY if args.tiny else {}
    if args.tiny and not args.memory_child:
        args.rounds, args.steps, args.mem_runs = 1, 1, 1
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.dropout, args.steps, size)
        return
    config = bench_config(args.dropout, **size)
    print(
        f"GPT-2 { ({**SIZE, **size}) } batch {BATCH}, dropout {args.dropout}, fp32, "
        f"{args.threads} thread(s)"
    )
    times = time_both(config, args.rounds, args.steps, warmup=0 if args.tiny else 2)
    mem = {
        k: memory(k, args.dropout, args.steps, args.mem_runs, args.threads, args.tiny)
        for k in ("megalite", "plain")
    }
    for k in ("plain", "megalite"):
        print(
            f"  {k:9s} step {times[k] * 1e3:8.1f} ms (median)   "
            f"peak RSS +{mem[k]['peak_delta'] / MIB:7.1f} MiB   "
            f"saved activations {mem[k]['saved'] / MIB:7.1f} MiB"
        )
    ratio = {
        "time": times["megalite"] / times["plain"],
        "peak RSS": mem["megalite"]["peak_delta"] / mem["plain"]["peak_delta"],
        "saved activations": mem["megalite"]["saved"] / mem["plain"]["saved"],
    }
    for name, value in ratio.items():
        print(f"  megalite / plain {name}: {value:.3f}x (target <= 1.10)")
    print(
        f"  megalite-loop step {times['megalite-loop'] * 1e3:8.1f} ms (median): "
        f"/ plain {times['megalite-loop'] / times['plain']:.3f}x (target <= 1.05), "
        f"/ megalite model alone {times['megalite-loop'] / times['megalite']:.3f}x"
    )


if __name__ == "__main__":
    main()
