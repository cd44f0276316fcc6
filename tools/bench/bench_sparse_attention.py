"""Block-sparse attention on CPU against dense causal SDPA in the same run: forward + backward time
and attention memory, at a window and at each sparse layout; and a long causal run with a window.

    python tools/bench/bench_sparse_attention.py                 # seq 8192, window 512, layouts
    python tools/bench/bench_sparse_attention.py --long 32768    # + a 32K-token run, window 1024
    python tools/bench/bench_sparse_attention.py --tiny          # seq 512: a smoke test (~15 s)
    python tools/bench/bench_sparse_attention.py --device cuda --block 128 \
        [--batch 4 --heads 16 --head-dim 128 --dtype bf16]       # the GPU table (cuda_table)

Attention of one sequence, ``--heads`` heads of ``--head-dim``, fp32, ``--threads`` intra-op
threads. Each mask runs ``--repeats`` forward+backward passes; the median time is divided by the
dense causal SDPA's (torch's CPU flash kernel, ``is_causal=True``) measured in the same process.
Density: the share of the ``s x s`` score entries the block-sparse path computes (whole blocks),
against dense causal's ~50%; the window runs by tiles (``band_attention``), the layouts by
blocks. Attention memory: the bytes autograd saves for backward plus the largest transient of one
kernel call (gathered K/V and the additive mask; by tiles: one call's grads, the output and the
contiguous output grad),
against what dense masked attention holds (a ``s x s`` mask, and the ``b n s s`` fp32 scores of
the math path that a non-causal mask falls back to). The long run reports this process's peak
resident memory (``ru_maxrss``) for the windowed pass and the bytes a dense masked pass would
need: not run.
Times on a shared machine are noisy; the ratios in one run are what to read, and ``--clock cpu``
(this process's CPU time) is steadier than wall time where other processes take the cores.

On CUDA (``--device cuda``) each mask runs on both paths: the block path and compiled flex
attention on the plan's ``BlockMask`` (``flex_sparse``; ``--block`` a multiple of 128), plus
causal through flex (flex's own price per entry beside the flash kernel's); time is the median
of ``--repeats`` after ``--warmup`` passes (flex compiles in the first), memory the device's
measured peak above the inputs during one pass, against dense causal SDPA's.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from megalite.core.attention.block_sparse import DEFAULT_MAX_ENTRIES, block_sparse_attention
from megalite.core.attention.flex_sparse import flex_plan_attention, plan_block_mask
from megalite.core.attention.masks import MaskSpec, build_block_plan
from megalite.core.attention.sparse_layouts import build_layout

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, inputs, repeats: int, clock: str = "wall", warmup: int = 0) -> float:
    now = CLOCKS[clock]
    device = inputs[0].device
    times = []
    for i in range(warmup + repeats):
        q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
        _sync(device)
        start = now()
        fn(q, k, v).sum().backward()
        _sync(device)
        if i >= warmup:
            times.append(now() - start)
    return statistics.median(times)


def _cuda_peak(fn, inputs) -> int:
    """Bytes the device allocated at its peak during one forward+backward, above the inputs."""
    device = inputs[0].device
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(q, k, v).sum().backward()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def _saved_bytes(fn, inputs) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return sum(seen.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _cases(args) -> list[tuple[str, MaskSpec]]:
    """The window and each layout at ~10% density: layout block counts are for 64-token blocks,
    scaled to keep the same token spans at other block sizes."""
    lb = args.block

    def blocks(n: int) -> int:
        return max(1, round(n * 64 / lb))

    return [
        (f"window {args.window}", MaskSpec(window=(args.window, 0))),
        (
            "fixed",
            MaskSpec(layout=build_layout("fixed", num_local_blocks=blocks(12)), layout_block=lb),
        ),
        (
            "bigbird",
            MaskSpec(
                layout=build_layout(
                    "bigbird",
                    num_window_blocks=blocks(7),
                    num_global_blocks=blocks(2),
                    num_random_blocks=blocks(6),
                ),
                layout_block=lb,
            ),
        ),
        (
            "longformer",
            MaskSpec(
                layout=build_layout(
                    "longformer",
                    num_window_blocks=blocks(21),
                    global_blocks=tuple(range(blocks(2))),
                ),
                layout_block=lb,
            ),
        ),
    ]


def cuda_table(args) -> None:
    """The same masks on the GPU: dense causal SDPA (flash), the block path and flex attention
    (compiled) on one plan each, forward+backward times and measured peak memory."""
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    s, n, d, blk = args.seq, args.heads, args.head_dim, args.block
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, n, s, d)
    inputs = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3)]
    scale = d**-0.5

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    reps = dict(repeats=args.repeats, warmup=args.warmup)
    dense_t, dense_mem = _time(dense, inputs, **reps), _cuda_peak(dense, inputs)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: batch {args.batch}, "
        f"seq {s}, {n} heads x {d}, block {blk}, {args.dtype}; median of {args.repeats} after "
        f"{args.warmup} warm-up (flex's compile)"
    )
    print(f"dense causal SDPA fwd+bwd: {dense_t * 1e3:.2f} ms, peak {_mib(dense_mem)}")
    print(
        f"{'mask':<14}{'density':>9}{'path':>7}{'time ms':>10}{'speed-up':>10}"
        f"{'peak memory':>14}{'vs dense':>10}"
    )
    pos = torch.arange(s, device=device)
    # causal through flex too: flex's own price per score entry against the flash kernel's
    for name, spec in [("causal (flex)", MaskSpec()), *_cases(args)]:
        plan = build_block_plan(spec, pos, pos, block_size=blk)
        density = plan.num_computed * blk * blk / (s * s)
        _sync(device)
        start = time.perf_counter()
        plan.flex_mask = plan_block_mask(plan)  # once per plan (the model caches its plans)
        _sync(device)
        print(f"{name}: flex BlockMask built in {(time.perf_counter() - start) * 1e3:.2f} ms")
        paths = {
            "block": lambda q, k, v, p=plan: block_sparse_attention(q, k, v, [p], scale=scale),
            "flex": lambda q, k, v, p=plan: flex_plan_attention(q, k, v, [p], scale=scale),
        }
        if spec.layout is None and spec.window is None:
            del paths["block"]  # dense through the block path: not a contender
        for path, fn in paths.items():
            try:
                t, mem = _time(fn, inputs, **reps), _cuda_peak(fn, inputs)
            except Exception as e:  # noqa: BLE001 - one path's failure is a row
                print(f"{name:<14}{100 * density:>8.1f}%{path:>7}  failed: {type(e).__name__}: {e}")
                continue
            print(
                f"{name:<14}{100 * density:>8.1f}%{path:>7}{t * 1e3:>10.2f}{dense_t / t:>9.1f}x"
                f"{_mib(mem):>14}{dense_mem / mem:>9.1f}x"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--block", type=int, default=64, help="compute and layout block (tokens)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--long", type=int, default=0, help="also a causal run of this length")
    p.add_argument("--long-window", type=int, default=1024)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="cuda only")
    p.add_argument("--batch", type=int, default=1, help="cuda only (CPU: one sequence)")
    p.add_argument("--warmup", type=int, default=2, help="cuda only: untimed passes first")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: this process's CPU time (steadier than wall time on a machine others load)",
    )
    args = p.parse_args()
    if args.tiny:
        args.seq, args.window, args.block, args.heads, args.head_dim = 512, 32, 32, 2, 16
        args.repeats, args.long = 1, 0
    if args.device == "cuda":
        return cuda_table(args)
    torch.set_num_threads(args.threads)
    s, n, d, blk = args.seq, args.heads, args.head_dim, args.block
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, n, s, d, generator=gen) for _ in range(3)]
    scale = d**-0.5

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    dense_t = _time(dense, inputs, args.repeats, args.clock)
    dense_masked = s * s + n * s * s * 4  # bool mask + fp32 scores (math path)
    print(
        f"seq {s}, {n} heads x {d}, block {blk}, {args.threads} threads, fp32, {args.clock} "
        "clock (shared machine)"
    )
    print(f"dense causal SDPA fwd+bwd: {dense_t:.3f} s")
    print(
        f"{'mask':<14}{'density':>9}{'time s':>9}{'speed-up':>10}{'attn memory':>14}"
        f"{'vs dense masked':>17}"
    )
    pos = torch.arange(s)
    for name, spec in _cases(args):
        plan = build_block_plan(spec, pos, pos, block_size=blk)
        density = plan.num_computed * blk * blk / (s * s)

        def sparse(q, k, v, plan=plan):
            return block_sparse_attention(q, k, v, [plan], scale=scale)

        t = _time(sparse, inputs, args.repeats, args.clock)
        if plan.band is not None:  # by tiles: one call's dq, dk, dv, the output, the output grad
            transient = 5 * n * s * d * 4
        else:  # gathered K/V and the mask of the largest call
            widest = max(c.shape[1] for _, c in plan.groups)
            rows = max(1, DEFAULT_MAX_ENTRIES // (blk * blk * widest))
            transient = 2 * n * rows * widest * blk * d * 4 + rows * blk * widest * blk * 4
        memory = _saved_bytes(sparse, inputs) + transient
        print(
            f"{name:<14}{100 * density:>8.1f}%{t:>9.3f}{dense_t / t:>9.1f}x{_mib(memory):>14}"
            f"{dense_masked / memory:>16.0f}x"
        )
    if args.long:
        s = args.long
        inputs = [torch.randn(1, n, s, d, generator=gen) for _ in range(3)]
        pos = torch.arange(s)
        plan = build_block_plan(MaskSpec(window=(args.long_window, 0)), pos, pos, block_size=blk)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = _time(lambda q, k, v: block_sparse_attention(q, k, v, [plan], scale=scale), inputs, 1)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        need = s * s + n * s * s * 4
        print(
            f"long: seq {s}, window {args.long_window}: fwd+bwd {t:.1f} s, process peak "
            f"{_mib(peak)} (before the run {_mib(before)}); dense masked attention would hold "
            f"{_mib(need)} (s x s bool mask + {n} heads of s x s fp32 scores): not run"
        )


if __name__ == "__main__":
    main()
