"""Fused Triton kernels vs PyTorch eager vs torch.compile, on one CUDA GPU.

    python tools/bench/bench_kernels.py [--repeats 7] [--no-compile] [--markdown]
    python tools/bench/bench_kernels.py --tiny    # seconds: one size per case, no torch.compile;
                                                  # without CUDA it says so and exits 0

For LayerNorm, RMSNorm (hidden 4096 and 8192, 16384 tokens) and scale-mask-softmax (causal and
boolean-mask, sk 2048 and 4096), all bf16, forward and backward separately, it prints the median
time of each implementation, the achieved bandwidth (bytes the op must move / time) as a fraction
of the device's copy bandwidth measured in the same run (``dst.copy_(src)`` on 1 GiB), and the
speedup over eager. The implementations:

- fused:    megalite.core.fusions with use_fused=True (the Triton kernels)
- eager:    the same functions with use_fused=False (the PyTorch reference megalite falls back to)
- compile:  torch.compile of that reference

Targets: fused forward and backward >= 70% of copy bandwidth and >= 1.5x eager.
Causal softmax reads only the visible half of x, so its bandwidth is counted on the full tensor
(effective GB/s) and may exceed the copy figure. Each row also prints max |fused - eager| of the
output and of dx, so a kernel that compiles wrongly on this GPU shows up here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core import fusions  # noqa: E402

TARGET_BANDWIDTH = 0.70
TARGET_SPEEDUP = 1.5
TOKENS = 16384  # e.g. micro-batch 4 x sequence 4096


def time_ms(fn: Callable[[], object], *, repeats: int, inner: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls, in ms."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def copy_bandwidth(repeats: int) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=repeats)
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def norm_case(kind: str, hidden: int):
    """(forward fn(use_fused), inputs needing grads, bytes forward, bytes backward)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=dt, generator=gen).requires_grad_(True)
    w = torch.randn(hidden, device="cuda", dtype=dt, generator=gen).requires_grad_(True)
    b = torch.randn(hidden, device="cuda", dtype=dt, generator=gen).requires_grad_(True)
    if kind == "layernorm":
        inputs = [x, w, b]

        def fn(use_fused: bool) -> Callable[..., torch.Tensor]:
            return lambda x, w, b: fusions.layer_norm(x, w, b, 1e-5, use_fused=use_fused)
    else:
        inputs = [x, w]

        def fn(use_fused: bool) -> Callable[..., torch.Tensor]:
            return lambda x, w: fusions.rms_norm(x, w, 1e-5, use_fused=use_fused)

    act = x.numel() * x.element_size()
    params = len(inputs[1:]) * hidden * dt.itemsize
    stats = TOKENS * 4 * (2 if kind == "layernorm" else 1)
    # forward: read x, write y; backward: read x and dy, write dx (params and stats are small)
    return fn, inputs, 2 * act + params + stats, 3 * act + 2 * params + stats


def softmax_case(variant: str, sk: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, heads = (2, 32) if sk <= 2048 else (1, 32)
    shape = (b, heads, sk, sk)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_(True)
    mask = None
    if variant == "mask":
        mask = torch.rand((b, 1, sk, sk), device="cuda", generator=gen) < 0.1
    scale = 1 / 8.0

    def fn(use_fused: bool) -> Callable[..., torch.Tensor]:
        return lambda x: fusions.scale_mask_softmax(
            x, scale=scale, causal=variant == "causal", mask=mask, use_fused=use_fused
        )

    act = x.numel() * x.element_size()
    mask_bytes = 0 if mask is None else mask.numel()
    return fn, [x], 2 * act + mask_bytes, 3 * act


def measure(fn, inputs, *, repeats: int):
    """(forward ms, backward ms, y, grads) of one implementation."""
    with torch.no_grad():
        fwd = time_ms(lambda: fn(*inputs), repeats=repeats)
    y = fn(*inputs)
    dy = torch.randn_like(y)
    bwd = time_ms(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True), repeats=repeats)
    grads = torch.autograd.grad(y, inputs, dy)
    return fwd, bwd, y.detach(), grads


def run_case(name: str, case, *, repeats: int, use_compile: bool, copy_gbs: float) -> list[dict]:
    fn, inputs, bytes_fwd, bytes_bwd = case
    impls = {"fused": fn(True), "eager": fn(False)}
    if use_compile:
        impls["compile"] = torch.compile(fn(False), dynamic=False)
    results = {}
    for impl, f in impls.items():
        results[impl] = measure(f, inputs, repeats=repeats)
        torch.cuda.empty_cache()
    _, _, y_e, g_e = results["eager"]
    _, _, y_f, g_f = results["fused"]
    err_y = (y_f.float() - y_e.float()).abs().max().item()
    err_dx = (g_f[0].float() - g_e[0].float()).abs().max().item()
    rows = []
    for pass_idx, (label, nbytes) in enumerate((("fwd", bytes_fwd), ("bwd", bytes_bwd))):
        eager_ms = results["eager"][pass_idx]
        for impl in impls:
            ms = results[impl][pass_idx]
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "case": name,
                    "pass": label,
                    "impl": impl,
                    "ms": ms,
                    "gbs": gbs,
                    "of_copy": gbs / copy_gbs,
                    "vs_eager": eager_ms / ms,
                    "err": err_y if label == "fwd" else err_dx,
                }
            )
    return rows


def print_table(rows: list[dict], *, markdown: bool) -> None:
    head = ["case", "pass", "impl", "ms", "GB/s", "% copy BW", "x eager", "max|fused-eager|"]
    lines = []
    for r in rows:
        err = f"{r['err']:.2e}" if r["impl"] == "fused" else ""
        cells = [r["case"], r["pass"], r["impl"], f"{r['ms']:.3f}", f"{r['gbs']:.0f}"]
        lines.append([*cells, f"{100 * r['of_copy']:.0f}%", f"{r['vs_eager']:.2f}", err])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is shown")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--only", choices=["norms", "softmax"], help="run one family only")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: one small size per case")
    args = parser.parse_args()
    if args.tiny:
        args.repeats, args.no_compile = 2, True
        if not torch.cuda.is_available():
            print("bench_kernels.py --tiny: no CUDA GPU on this machine, nothing to time")
            return
    if not torch.cuda.is_available():
        sys.exit(
            "bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
            "(the kernels' CPU checks are the tests: python -m pytest -q tests/kernels)"
        )
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_kernels.py: unset TRITON_INTERPRET; the interpreter is for CPU tests only")

    copy_gbs = copy_bandwidth(args.repeats)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (median)")
    cases = []
    if args.only in (None, "norms"):
        for kind in ("layernorm", "rmsnorm"):
            for hidden in (1024,) if args.tiny else (4096, 8192):
                cases.append(
                    (f"{kind} [{TOKENS}, {hidden}]", lambda k=kind, h=hidden: norm_case(k, h))
                )
    if args.only in (None, "softmax"):
        for variant in ("causal", "mask"):
            for sk in (256,) if args.tiny else (2048, 4096):
                cases.append(
                    (f"softmax-{variant} sk={sk}", lambda v=variant, s=sk: softmax_case(v, s))
                )
    rows = []
    for name, make in cases:
        rows += run_case(
            name, make(), repeats=args.repeats, use_compile=not args.no_compile, copy_gbs=copy_gbs
        )
        torch.cuda.empty_cache()
    print_table(rows, markdown=args.markdown)

    fused = [r for r in rows if r["impl"] == "fused"]
    misses = [r for r in fused if r["of_copy"] < TARGET_BANDWIDTH or r["vs_eager"] < TARGET_SPEEDUP]
    print(
        f"\ntargets: fused >= {100 * TARGET_BANDWIDTH:.0f}% of copy bandwidth and >= "
        f"{TARGET_SPEEDUP}x eager: {len(fused) - len(misses)} of {len(fused)} met"
    )
    for r in misses:
        print(
            f"  missed: {r['case']} {r['pass']}: {100 * r['of_copy']:.0f}% of copy, "
            f"{r['vs_eager']:.2f}x eager"
        )


if __name__ == "__main__":
    main()
