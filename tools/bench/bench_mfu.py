"""Model FLOPs utilisation of a training step on one GPU: megalite vs plain PyTorch, same process.

    python tools/bench/bench_mfu.py [--models gpt2-1.3b llama-1b] [--kinds megalite plain compile]
        [--steps 10] [--out-md FILE] [--out-json FILE]
    python tools/bench/bench_mfu.py --device cpu --tiny     # seconds-long smoke run of the code

Models (``--seq 2048``): GPT-2 1.3B-shaped (24 layers, hidden 2048, 16 heads, learned positions,
LayerNorm, GELU, biases, tied embeddings, vocab 50257) and Llama 1B-shaped (16 layers, hidden 2048,
FFN 8192, 32 heads in 8 query groups, RoPE, RMSNorm, SwiGLU, no biases, tied, vocab 128256).
Each is timed in the same process, with Megatron's mixed precision or PyTorch's:

- megalite: pretrain_gpt.py's flags with ``--bf16 --accumulate-allreduce-grads-in-fp32`` (bf16
  params and activations, fp32 grads and fp32 master weights in the optimizer), run through its
  own training step: ``build_run`` on a world of one (nccl on CUDA), ``Trainer.step`` on mock data;
- plain: the same architecture in nn.Linear / F.scaled_dot_product_attention, PyTorch AMP (fp32
  params, ``torch.autocast(bfloat16)``, fused AdamW);
- compile: ``torch.compile`` of plain (slow to build: ask for it with ``--kinds``).

The micro-batch (global batch = micro-batch, one per step) is fixed before anything runs: the
largest of ``--micro-batches`` whose megalite run the planner predicts to fit in ``MARGIN`` of the
device's usable memory (``megalite.planning.search.evaluate`` at TP1 PP1 DP1); every kind runs at
it, except that a plain kind out of memory there runs at half, down to 1 (``measure``). Reported
per kind: step time (median of ``--steps`` after ``--warmup``), tokens/s, TFLOP/s and MFU by
``megalite.training.flops`` (the formula megalite logs: model FLOPs, no recomputation, causal
mask not discounted), peak ``torch.cuda.max_memory_allocated``, and for megalite the planner's
predicted step time, MFU and peak memory beside them; then megalite / plain in tokens/s.
``--out-json`` has every figure. Exit status 1 if a kind failed (out of memory included:
megalite at the planner's size, plain at 1), 2 without CUDA (unless ``--device cpu``: no
peak TFLOP/s there, MFU is "-").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import init_single_process  # noqa: E402
from megalite.models import GPTConfig  # noqa: E402
from megalite.planning.cluster import PRESETS, Cluster, preset  # noqa: E402
from megalite.planning.predict import Layout  # noqa: E402
from megalite.planning.search import evaluate  # noqa: E402
from megalite.training.arguments import parse_args  # noqa: E402
from megalite.training.config import PretrainConfig, with_tokenizer  # noqa: E402
from megalite.training.flops import model_flops_per_iteration, peak_tflops  # noqa: E402
from megalite.training.forward_step import make_forward_step  # noqa: E402
from megalite.training.model_chunks import grad_wrappers  # noqa: E402
from megalite.training.pretrain import build_run, mesh_for  # noqa: E402
from tools.bench.bench_gpt_step import PlainGPT  # noqa: E402

GIB = 2**30
# share of the usable memory (device memory less the planner's reserve) the predicted peak may
# fill: plain AMP keeps fp32 weights plus autocast's bf16 copies and an fp32 residual stream
MARGIN = 0.8
PRECISION = ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
MODELS = {  # pretrain_gpt.py's model flags, without the sequence length
    "gpt2-1.3b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --vocab-size 50257",
    "llama-1b": (
        "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 8192 --position-embedding-type rope "
        "--rotary-base 500000 --normalization RMSNorm --swiglu --disable-bias-linear "
        "--vocab-size 128256"
    ),
}
DEFAULTS = {"seq": 2048, "micro_batches": [1, 2, 4, 8, 16, 32], "steps": 10, "warmup": 3}
TINY_DEFAULTS = {"seq": 32, "micro_batches": [1, 2], "steps": 1, "warmup": 0}
TINY = {
    "gpt2-1.3b": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 511",
    "llama-1b": (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --ffn-hidden-size 128 --position-embedding-type rope "
        "--normalization RMSNorm --swiglu --disable-bias-linear --vocab-size 511"
    ),
}


def model_argv(name: str, seq: int, tiny: bool) -> list[str]:
    shape = (TINY if tiny else MODELS)[name].split()
    return [*shape, "--seq-length", str(seq), "--max-position-embeddings", str(seq), *NO_DROPOUT]


def run_config(argv: list[str], mbs: int, iters: int) -> PretrainConfig:
    """pretrain_gpt.py's config for ``iters`` steps of micro-batch ``mbs`` on mock data."""
    run = ["--micro-batch-size", str(mbs), "--global-batch-size", str(mbs)]
    run += ["--train-iters", str(iters), "--lr", "1e-4", "--mock-data", "--eval-iters", "0"]
    run += ["--tokenizer-type", "NullTokenizer", "--log-interval", str(iters + 1)]
    return with_tokenizer(parse_args([*argv, *PRECISION, *run], env={}))


# --- the micro-batch, from the planner ------------------------------------------------------------


def device_cluster(device: torch.device, name: str, memory_gib: float | None) -> Cluster:
    """The planner's one-device cluster: a preset when the name has one, this device's memory."""
    if memory_gib is None:
        memory_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    key = next((k for k in sorted(PRESETS, key=len, reverse=True) if k in name), None)
    if key is not None:
        return preset(key, 1, gpu_memory_gib=memory_gib)
    peak = peak_tflops(name if device.type == "cuda" else None, "bf16") or 1.0
    return Cluster(
        gpus=1,
        gpus_per_node=1,
        gpu_memory_gib=memory_gib,
        peak_tflops=peak,
        intra_node_gbps=1.0,
        inter_node_gbps=1.0,
        device=device.type,
        name=name,
    )


def plan(argv: list[str], vocab: int, cluster: Cluster, sizes: list[int]) -> dict:
    """The largest micro-batch of ``sizes`` predicted to fit in MARGIN of the usable memory, with
    the planner's figures for it and every size it looked at."""
    looked, best = [], None
    for mbs in sorted(sizes):
        layout = Layout(micro_batch_size=mbs)
        cand = evaluate(
            argv, layout, cluster, vocab_size=vocab, global_batch_size=mbs, extra=PRECISION
        )
        if cand.error:
            raise SystemExit(f"bench_mfu.py: the planner refuses the model: {cand.error}")
        fits = cand.peak_bytes <= MARGIN * cluster.usable_bytes
        looked.append({"micro_batch": mbs, "predicted_gib": cand.peak_bytes / GIB, "fits": fits})
        if fits:
            best = {"micro_batch": mbs, "predicted_gib": cand.peak_bytes / GIB}
            best.update(predicted_step_s=cand.step.seconds, predicted_mfu=cand.step.mfu)
    if best is None:
        raise SystemExit(f"bench_mfu.py: no micro-batch of {sizes} is predicted to fit: {looked}")
    return {**best, "usable_gib": cluster.usable_bytes / GIB, "margin": MARGIN, "looked": looked}


# --- the plain PyTorch models (GPT-2: tools/bench/bench_gpt_step.PlainGPT) -----------------------


class PlainRMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: # [b, n, s, d]; rotate-half RoPE (HF Llama layout), in x's dtype."""
    x1, x2 = x.chunk(2, -1)
    return (x * cos + torch.cat((-x2, x1), -1) * sin).to(x.dtype)


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
        if not c.untie_embeddings_and_output_weights:
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
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


# --- timing -------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step(step: Callable[[], None], device: torch.device, *, warmup: int, steps: int):
    for _ in range(warmup):  # allocator, optimizer state, compilation
        step()
    sync(device)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_megalite(cfg: PretrainConfig, device: torch.device, *, warmup: int, steps: int) -> dict:
    """megalite's own step: build_run on a world of one, Trainer.step over the mock data."""
    ps = mesh_for(cfg.parallel, device=device)
    try:
        run = build_run(cfg, ps, device, resume=False)
        trainer, forward_step = run.trainer, make_forward_step(device)
        seconds = median_step(
            lambda: trainer.step(forward_step, run.train_iter), device, warmup=warmup, steps=steps
        )
        param = next(p for chunk in trainer.model for p in chunk.module.parameters())
        grads = {
            b.grad_dtype for w in grad_wrappers(trainer.model) for b in w.buffers_by_key.values()
        }
        precision = {
            "params": str(param.dtype).removeprefix("torch."),
            "grads": "/".join(sorted(str(g).removeprefix("torch.") for g in grads)),
            "master": str(trainer.optimizer.master_params[0].dtype).removeprefix("torch."),
        }
        return {"seconds": seconds, "precision": precision}
    finally:
        ps.destroy()


def time_plain(
    kind: str,
    name: str,
    config: GPTConfig,
    device: torch.device,
    mbs: int,
    *,
    warmup: int,
    steps: int,
) -> dict:
    """PyTorch AMP: fp32 params, autocast to bf16, fused AdamW (on CUDA)."""
    torch.manual_seed(config.seed)
    with torch.device(device):
        model = (PlainLlama if name == "llama-1b" else PlainGPT)(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if kind == "compile" else model
    g = torch.Generator(device=device).manual_seed(0)
    shape = (mbs, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, device=device, generator=g)
    labels = torch.randint(0, config.vocab_size, shape, device=device, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(tokens, labels)
        loss.backward()
        opt.step()

    seconds = median_step(step, device, warmup=warmup, steps=steps)
    precision = {"params": "float32", "grads": "float32", "master": "-", "autocast": "bfloat16"}
    return {"seconds": seconds, "precision": precision}


def measure(kind: str, name: str, cfg: PretrainConfig, device: torch.device, args) -> dict:
    """One kind's row: timings and figures, or its failure (out of memory, an error). A plain
    kind that runs out of memory at the planner's micro-batch runs at half of it, down to 1 (its
    row names the sizes that did not fit): PyTorch AMP keeps fp32 params and fp32 logits, so it
    can need more memory than megalite at the same micro-batch."""
    mbs = cfg.training.micro_batch_size
    did_not_fit: list[int] = []
    while True:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            if kind == "megalite":
                row = time_megalite(cfg, device, warmup=args.warmup, steps=args.steps)
            else:  # the plain model's vocabulary is megalite's padded one: the same matmuls
                plain = replace(cfg.model, vocab_size=cfg.model.padded_vocab_size(1))
                steps = {"warmup": args.warmup, "steps": args.steps}
                row = time_plain(kind, name, plain, device, mbs, **steps)
            row["status"] = "ok"
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        except torch.OutOfMemoryError as e:
            row = {"status": "out of memory", "error": str(e).splitlines()[0]}
        except Exception as e:  # noqa: BLE001 - one kind's failure is a row; the others still run
            traceback.print_exc()
            row = {"status": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        gc.collect()
        if device.type == "cuda":  # the model, its grads and optimizer state are gone
            torch.cuda.empty_cache()
        if row["status"] != "out of memory" or kind == "megalite" or mbs == 1:
            break
        did_not_fit.append(mbs)
        mbs //= 2
    if did_not_fit:
        row["did_not_fit"] = did_not_fit
    return {"model": name, "impl": kind, "micro_batch": mbs, **row}


def step_flops(cfg: PretrainConfig) -> int:
    """Model FLOPs of one step, as megalite's progress line counts them (``training.flops``)."""
    m = cfg.model
    return model_flops_per_iteration(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        seq_length=m.seq_length,
        global_batch_size=cfg.training.global_batch_size,
        padded_vocab_size=m.padded_vocab_size(1),
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.kv_channels,
        num_query_groups=m.num_query_groups,
        swiglu=m.swiglu,
    )


def figures(row: dict, cfg: PretrainConfig, peak: float | None) -> dict:
    """Tokens/s, TFLOP/s and MFU of a measured row."""
    if row["status"] != "ok":
        return row
    share = row["micro_batch"] / cfg.training.global_batch_size  # a plain run at a smaller one
    tflops = step_flops(cfg) * share / row["seconds"] / 1e12
    return {
        **row,
        "tokens_s": row["micro_batch"] * cfg.model.seq_length / row["seconds"],
        "tflops": tflops,
        "mfu": 100.0 * tflops / peak if peak else None,
    }


def _num(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


HEADER = [
    "| model | impl | precision (params/grads/master) | micro-batch | step ms | tokens/s | TFLOP/s "
    "| MFU | peak GiB | planner: step ms | planner: MFU | planner: GiB |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def table_row(r: dict) -> str:
    p = r.get("precision")
    precision = f"{p['params']}/{p['grads']}/{p['master']}" if p else "-"
    if p and "autocast" in p:
        precision += f" (autocast {p['autocast']})"
    mbs = str(r["micro_batch"])
    if r.get("did_not_fit"):
        mbs += f" ({', '.join(map(str, r['did_not_fit']))}: out of memory)"
    head = f"| {r['model']} | {r['impl']} | {precision} | {mbs} |"
    if r["status"] != "ok":
        return f"{head} {r['status']} | | | | | | | |"
    predicted_ms = r.get("predicted_step_s")
    return (
        f"{head} {r['seconds'] * 1e3:.1f} | {r['tokens_s']:,.0f} | {r['tflops']:.1f} | "
        f"{_num(r['mfu'], '.1f', '%')} | {_num(r.get('peak_gib'), '.2f')} | "
        f"{_num(predicted_ms and predicted_ms * 1e3, '.1f')} | "
        f"{_num(r.get('predicted_mfu'), '.1f', '%')} | {_num(r.get('predicted_gib'), '.2f')} |"
    )


def markdown(report: dict) -> list[str]:
    """The table (one row per model and kind) and the ratios, as docs/PERFORMANCE.md shows them."""
    tiny = " (tiny models)" if report["tiny"] else ""
    title = (
        f"device: {report['device']}, torch {report['torch']}, seq {report['seq']}, "
        f"peak {_num(report['peak_tflops'], 'g')} TFLOP/s bf16{tiny}"
    )
    lines = [title, "", *HEADER, *(table_row(r) for r in report["rows"]), ""]
    return lines + [f"{k}: {v:.2f}x" for k, v in report["ratios"].items()]


def run_model(model: str, args, device: torch.device, cluster: Cluster, report: dict) -> None:
    """Plan the micro-batch of ``model``, time every kind at it, add rows and ratios."""
    argv = model_argv(model, args.seq, args.tiny)
    vocab = int(argv[argv.index("--vocab-size") + 1])
    chosen = plan(argv, vocab, cluster, args.micro_batches)
    report["planner"][model] = chosen
    cfg = run_config(argv, chosen["micro_batch"], args.warmup + args.steps)
    rows = {}
    for kind in args.kinds:
        row = figures(measure(kind, model, cfg, device, args), cfg, report["peak_tflops"])
        if kind == "megalite":  # the planner's MFU needs the device's peak
            row.update(
                predicted_step_s=chosen["predicted_step_s"], predicted_gib=chosen["predicted_gib"]
            )
            row["predicted_mfu"] = chosen["predicted_mfu"] if report["peak_tflops"] else None
        rows[kind] = row
        report["rows"].append(row)
        print(table_row(row), flush=True)
    mine = rows.get("megalite")
    for other in ("plain", "compile"):
        theirs = rows.get(other)
        if mine and theirs and mine["status"] == theirs["status"] == "ok":
            ratio = mine["tokens_s"] / theirs["tokens_s"]
            report["ratios"][f"{model}: megalite / {other} tokens/s"] = ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    kinds = ["megalite", "plain", "compile"]
    parser.add_argument("--kinds", nargs="+", choices=kinds, default=kinds[:2])
    parser.add_argument("--seq", type=int, help="sequence length (2048; --tiny: 32)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        help="the sizes the planner chooses from, the largest predicted to fit (1 2 4 8 16 32; "
        "--tiny: 1 2)",
    )
    parser.add_argument(
        "--steps", type=int, help="timed steps, the median is shown (10; --tiny: 1)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps before them (3; --tiny: 0)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--memory-gib", type=float, help="memory for the planner (GPU: its own)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke test of the code)")
    parser.add_argument("--out-md", help="also write the markdown table to this file")
    parser.add_argument("--out-json", help="also write every figure (JSON) to this file")
    args = parser.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_mfu.py: no CUDA GPU (torch.cuda.is_available() is False): nothing measured "
            "(--device cpu --tiny runs the code on CPU)"
        )
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    name = "cpu"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    memory = args.memory_gib or (16.0 if device.type == "cpu" else None)
    report = {
        "device": name,
        "torch": torch.__version__,
        "seq": args.seq,
        "tiny": args.tiny,
        "peak_tflops": peak_tflops(name if device.type == "cuda" else None, "bf16"),
        "margin": MARGIN,
        "planner": {},
        "rows": [],
        "ratios": {},
    }
    print("\n".join(markdown(report)[:-1]), flush=True)  # the title and the header
    init_single_process(device)  # a world of one: nccl on CUDA, gloo on CPU
    try:
        for model in args.models:
            run_model(model, args, device, device_cluster(device, name, memory), report)
    finally:
        dist.destroy_process_group()
    lines = markdown(report)
    print("\n".join(lines))
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
