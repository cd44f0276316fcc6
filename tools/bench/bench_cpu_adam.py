"""The host Adam step of offloaded optimizer state: megalite's against torch's and DeepSpeed's.

    python tools/bench/bench_cpu_adam.py [--numel 10e6 50e6 100e6] [--runs 5]
    python tools/bench/bench_cpu_adam.py --tiny           # seconds: one 200k-element shard, 1 run
    /tmp/venv-ds/bin/python tools/bench/bench_cpu_adam.py  # a venv with deepspeed: its row too

One shard of fp32 optimizer state on the host, cut into a GPT's parameters (per layer the QKV,
projection and two MLP matrices of hidden 1024 and their biases and norms, as many layers as fit;
the same pieces for every row), AdamW (lr 1e-3, weight decay 0.1 on the matrices, 0 on the rest),
the same grads each step. Rows, each the median seconds of ``--runs`` steps after one warm-up,
taken in rounds of one step of every row:

- ``megalite``: ``ShardedOptimizer``'s host step (``_step_on_host``) with the whole shard
  offloaded (``OffloadSpec(fraction=1)``): torch's fused CPU Adam over the host pieces;
- ``torch-single``: ``torch.optim.AdamW`` with its CPU default (the single-tensor loop): what the
  host pieces went through before;
- ``torch-foreach``, ``torch-fused``: ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)``;
- ``blocked``: torch's single-tensor arithmetic over cache-sized blocks (bit-equal to it);
- ``deepspeed``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` (AVX + OpenMP, its C++
  op built on first use), when ``deepspeed`` imports; else the reason is printed.

Printed per row: seconds, the ratio to ``torch-fused`` and to ``torch-single``, and the largest
difference of the params from ``torch-single``'s after the same steps (0: bit-equal). Threads:
torch's default (the machine's cores) for every row. Times are of this machine at the time of the
run; only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.distributed import Zero1DataParallel  # noqa: E402
from megalite.core.optimizer import OffloadSpec, build_sharded_optimizer  # noqa: E402

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.999), 1e-8


def piece_shapes(numel: int, hidden: int) -> list[tuple[int, ...]]:
    """A GPT's parameters, layer after layer, until ``numel`` elements (the last one cut)."""
    h = hidden
    layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,)]
    layer += [(h, 4 * h), (h,)]
    shapes, total = [], 0
    while total < numel:
        for shape in layer:
            n = min(torch.Size(shape).numel(), numel - total)
            if n == 0:
                break
            shapes.append(shape if n == torch.Size(shape).numel() else (n,))
            total += n
    return shapes


def make_params(shapes, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def make_grads(shapes, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 1e-2 for s in shapes]


def groups_of(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": WD},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def blocked_adamw(params, grads, states, step: int, block: int = 1 << 16) -> None:
    """torch's single-tensor AdamW, op for op, over blocks of ``block`` elements."""
    beta1, beta2 = BETAS
    step_size = LR / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    buffer = torch.empty(block)
    for param, grad, (exp_avg, exp_avg_sq) in zip(params, grads, states):
        wd = WD if param.ndim > 1 else 0.0
        flat = [t.view(-1) for t in (param.data, grad, exp_avg, exp_avg_sq)]
        for a in range(0, flat[0].numel(), block):
            p, g, m, v = (t[a : a + block] for t in flat)
            if wd:
                p.mul_(1 - LR * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = torch.sqrt(v, out=buffer[: p.numel()]).div_(bias_correction2_sqrt).add_(EPS)
            p.addcdiv_(m, denom, value=-step_size)


def torch_row(**options) -> Callable:
    def setup(shapes):
        params, grads = make_params(shapes), make_grads(shapes)
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(groups_of(params), lr=LR, betas=BETAS, eps=EPS, **options)
        return opt.step, lambda: params

    return setup


def blocked_row(shapes):
    params, grads = make_params(shapes), make_grads(shapes)
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    count = [0]

    def step():
        count[0] += 1
        with torch.no_grad():
            blocked_adamw(params, grads, states, count[0])

    return step, lambda: params


class _Pieces(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList(make_params(shapes))


def megalite_row(shapes):
    module = _Pieces(shapes)
    model = Zero1DataParallel(module, dp_group=None)
    betas = {"adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS}
    opt = build_sharded_optimizer(
        model, lr=LR, weight_decay=WD, offload=OffloadSpec(fraction=1.0), **betas
    )
    grads = dict(zip(module.weights, make_grads(shapes)))
    assert {pc.where for pc in opt.pieces} == {"host"}
    opt._host_grads = {  # the grads the step's earlier phases would copy next to the masters
        id(pc): grads[pc.param].view(-1)[pc.lo : pc.hi] for pc in opt.pieces
    }

    def step():
        host_grads = dict(opt._host_grads)
        opt._step_on_host()
        opt._host_grads = host_grads

    def params():  # the masters, in the shapes of the params
        out = []
        for p in module.weights:
            parts = [pc.master for pc in opt.pieces if pc.param is p]
            out.append(torch.cat([t.detach() for t in parts]).view(p.shape))
        return out

    return step, params


def deepspeed_row(shapes):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # only where deepspeed is installed

    params, grads = make_params(shapes), make_grads(shapes)
    for p, g in zip(params, grads):
        p.grad = g
    opt = DeepSpeedCPUAdam(groups_of(params), lr=LR, betas=BETAS, eps=EPS, adamw_mode=True)
    return opt.step, lambda: params


ROWS = {
    "torch-single": torch_row(foreach=False),
    "megalite": megalite_row,
    "torch-foreach": torch_row(foreach=True),
    "torch-fused": torch_row(fused=True),
    "blocked": blocked_row,
    "deepspeed": deepspeed_row,
}


def measure(shapes, runs: int) -> dict[str, tuple[float, list[torch.Tensor]] | str]:
    """Every row set up at once, then ``runs`` rounds of one step of each in turn (round-robin
    spreads the drift of a shared machine over all rows); per row the median and its params."""
    steps, params, out = {}, {}, {}
    for name, setup in ROWS.items():
        try:
            steps[name], params[name] = setup(shapes)
        except Exception as e:  # deepspeed missing or its op not buildable: say why, keep the rest
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    for step in steps.values():
        step()  # warm-up (and DeepSpeed's first-use build)
    times = {name: [] for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    for name in steps:
        out[name] = statistics.median(times[name]), [p.detach() for p in params[name]()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, nargs="+", default=[10e6, 50e6, 100e6])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="one 200k-element shard, 1 run")
    args = parser.parse_args()
    if args.tiny:
        args.numel, args.runs, args.hidden = [2e5], 1, 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for numel in args.numel:
        shapes = piece_shapes(int(numel), args.hidden)
        print(f"\nshard of {int(numel):,} fp32 elements in {len(shapes)} pieces, {args.runs} runs")
        results = measure(shapes, args.runs)
        ref_time, ref_params = results["torch-single"]
        fused_time = results["torch-fused"][0]
        print(f"{'row':<14} {'median s':>10} {'/ fused':>8} {'/ single':>9} {'max |dp|':>10}")
        for name in ROWS:
            result = results[name]
            if isinstance(result, str):
                print(f"{name:<14} not run: {result}")
                continue
            t, params = result
            diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params))
            print(
                f"{name:<14} {t:>10.4f} {t / fused_time:>8.2f} {t / ref_time:>9.2f} {diff:>10.2e}"
            )


if __name__ == "__main__":
    main()
