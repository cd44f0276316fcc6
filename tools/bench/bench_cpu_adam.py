"""The host Adam step of offloaded optimizer state: megalite's against torch's and DeepSpeed's.

    python tools/bench/bench_cpu_adam.py [--numel 1e6 10e6 50e6] [--threads 1 2] [--runs 5]
    python tools/bench/bench_cpu_adam.py --tiny           # seconds: one 200k-element shard, 1 run
    /tmp/venv-ds/bin/python tools/bench/bench_cpu_adam.py  # a venv with deepspeed: its row too

One shard of fp32 optimizer state on the host, cut into a GPT's parameters (per layer the QKV,
projection and two MLP matrices of hidden 1024 and their biases and norms, as many layers as fit;
the same pieces for every row), AdamW (lr 1e-3, weight decay 0.1 on the matrices, 0 on the rest).
Rows:

- ``megalite-host``: ``ShardedOptimizer``'s host step (``_step_on_host``, what the host rungs of
  ``bench_zero_ladder.py`` run) with the whole shard offloaded (``OffloadSpec(fraction=1)``);
- ``megalite-files``: its step over state in files (``_step_on_disk``, the files rung), the
  files under a temporary directory (in the page cache: what is timed is the CPU's part), 64 MiB
  of host buffers as in ``bench_zero_ladder.py``;
- ``torch-fused``, ``torch-foreach``, ``torch-loop``: ``torch.optim.AdamW`` with ``fused=True``,
  ``foreach=True``, ``foreach=False`` (the single-tensor loop, torch's CPU default);
- ``deepspeed``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` (fp32 params, its
  ``step``: its AVX C++ op, OpenMP threads), when ``deepspeed`` imports. Its op is taken prebuilt
  from torch's extension cache when there (``deepspeed_op``), since DeepSpeed's own loader
  rebuilds it whenever the build's object files are gone (35 minutes on a loaded 2-core
  machine); else through DeepSpeed's loader. Without deepspeed the row prints why.

Timing: for each shard size and each thread count (``torch.set_num_threads``, which the
DeepSpeed op's OpenMP follows too: it runs in torch's libgomp), every row steps once in turn,
``--runs`` rounds after one warm-up round; before each step a 64 MiB buffer is written, so no row
finds the state in the cache the previous one left. Per row: the median process CPU seconds
(every thread's; the steadier figure on a shared machine) and wall seconds of a step, and their
ratios to ``torch-fused``'s. To bound memory, the rows step one shared state (megalite-host's
host buffers; only the files row has its own): the values drift apart from any one optimizer's,
which the kernels' speed does not depend on.

Correctness, before the timings, on a separate 200k-element shard: every row from the same
parameters and zero moments, 3 steps of the same grads, its own state; printed: the largest
difference of its params from ``torch-loop``'s (0: bit-equal).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.distributed import Zero1DataParallel  # noqa: E402
from megalite.core.optimizer import OffloadSpec, build_sharded_optimizer  # noqa: E402

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.999), 1e-8
FILES_HOST_BYTES = 64 << 20  # the files rung's host buffers, as in bench_zero_ladder.py
CHECK_NUMEL, CHECK_STEPS = 200_000, 3
DEEPSPEED_OP_CACHE = "~/.cache/torch_extensions/py*_cpu/cpu_adam/cpu_adam.so"


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


def make_params(shapes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def make_grads(shapes, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 1e-2 for s in shapes]


@dataclass
class State:
    """Per piece: param, grad, exp_avg, exp_avg_sq (fp32, in the shapes of the pieces)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]

    @classmethod
    def fresh(cls, shapes) -> State:
        params = make_params(shapes)
        zeros = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        return cls(params, make_grads(shapes), *zeros)


def groups_of(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": WD},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def adopt(opt: torch.optim.Optimizer, params, state: State, step) -> None:
    """``opt``'s per-param state set to views of ``state``'s moments (``step``: its first)."""
    for p, m, v in zip(params, state.exp_avgs, state.exp_avg_sqs):
        opt.state[p] = {"step": step(), "exp_avg": m, "exp_avg_sq": v}


def torch_row(**options) -> Callable:
    def setup(shapes, state: State):
        params = [nn.Parameter(t) for t in state.params]  # aliases of the state's storage
        for p, g in zip(params, state.grads):
            p.grad = g
        opt = torch.optim.AdamW(groups_of(params), lr=LR, betas=BETAS, eps=EPS, **options)
        adopt(opt, params, state, lambda: torch.zeros((), dtype=torch.float32))
        return opt.step, lambda: params

    return setup


def deepspeed_op():
    """DeepSpeed's ``cpu_adam`` extension, prebuilt in torch's extension cache (None if absent)."""
    for path in glob.glob(os.path.expanduser(DEEPSPEED_OP_CACHE)):
        spec = importlib.util.spec_from_file_location("cpu_adam", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return None


def use_prebuilt_deepspeed_op() -> bool:
    """Make DeepSpeed's CPU Adam builder return the prebuilt op (``deepspeed_op``) instead of
    rebuilding it; False (nothing changed) where there is none."""
    from deepspeed.ops.op_builder import CPUAdamBuilder  # only where deepspeed is installed

    op = deepspeed_op()
    if op is not None:  # DeepSpeedCPUAdam takes its op from the builder's load()
        CPUAdamBuilder.load = lambda self, verbose=True: op
    return op is not None


def deepspeed_row(shapes, state: State):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # only where deepspeed is installed
    except ImportError as e:
        raise ImportError(f"deepspeed is not importable by {sys.executable} (see the usage)") from e

    use_prebuilt_deepspeed_op()
    params = [nn.Parameter(t) for t in state.params]
    for p, g in zip(params, state.grads):
        p.grad = g
    opt = DeepSpeedCPUAdam(groups_of(params), lr=LR, betas=BETAS, eps=EPS, adamw_mode=True)
    adopt(opt, params, state, lambda: 0)
    return opt.step, lambda: params


class _Pieces(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(t.clone()) for t in tensors])


def _megalite(shapes, offload: OffloadSpec):
    init = State.fresh(shapes)
    module = _Pieces(init.params)
    model = Zero1DataParallel(module, dp_group=None)
    betas = {"adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS}
    opt = build_sharded_optimizer(model, lr=LR, weight_decay=WD, offload=offload, **betas)
    grads = dict(zip(module.weights, init.grads))
    grads = [grads[pc.param].view(-1)[pc.lo : pc.hi] for pc in opt.pieces]
    return module, opt, grads


def _masters_as_params(module, opt) -> list[torch.Tensor]:
    out = []
    for p in module.weights:
        parts = [pc.master for pc in opt.pieces if pc.param is p]
        out.append(torch.cat([t.detach() for t in parts]).view(p.shape))
    return out


def megalite_host(shapes):
    """(step, params, the shared State: views of its host buffers)."""
    module, opt, grads = _megalite(shapes, OffloadSpec(fraction=1.0))
    assert {pc.where for pc in opt.pieces} == {"host"}

    def step():  # the grads the step's earlier phases copy next to the masters
        opt._host_grads = {id(pc): g for pc, g in zip(opt.pieces, grads)}
        opt._step_on_host()

    sb = opt.buffers[0]
    views = {
        key: [sb.host[key].narrow(0, pc.shard_lo, pc.hi - pc.lo) for pc in opt.pieces]
        for key in ("master", "exp_avg", "exp_avg_sq")
    }
    state = State(views["master"], grads, views["exp_avg"], views["exp_avg_sq"])
    return step, lambda: _masters_as_params(module, opt), state


def megalite_files(shapes, directory: str):
    offload = OffloadSpec(directory=directory, host_bytes=FILES_HOST_BYTES)
    module, opt, grads = _megalite(shapes, offload)
    assert {pc.where for pc in opt.pieces} == {"disk"}

    def step():
        opt.steps += 1
        opt._piece_grads = grads
        opt._step_on_disk()

    def params():  # the masters, read back from the files
        return [p.detach().clone() for p in module.weights]

    return step, params, opt.remove_offload_files


TORCH_ROWS = {
    "torch-fused": torch_row(fused=True),
    "torch-foreach": torch_row(foreach=True),
    "torch-loop": torch_row(foreach=False),
    "deepspeed": deepspeed_row,
}
ROWS = ("megalite-host", "megalite-files", *TORCH_ROWS)


def build_rows(shapes, directory: str, shared: bool) -> tuple[dict, dict, list]:
    """``(steps, params, cleanups)`` of every row; a reason string in place of a step for a row
    that cannot run. ``shared``: the torch and DeepSpeed rows step megalite-host's state."""
    steps, params, cleanups = {}, {}, []
    steps["megalite-host"], params["megalite-host"], host_state = megalite_host(shapes)
    steps["megalite-files"], params["megalite-files"], remove = megalite_files(shapes, directory)
    cleanups.append(remove)
    for name, setup in TORCH_ROWS.items():
        try:
            steps[name], params[name] = setup(shapes, host_state if shared else State.fresh(shapes))
        except Exception as e:  # deepspeed missing or its op not loadable: say why, keep the rest
            steps[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    return steps, params, cleanups


def check(directory: str) -> None:
    """Every row's params after ``CHECK_STEPS`` steps from the same start, against torch-loop's."""
    torch.set_num_threads(1)
    steps, params, cleanups = build_rows(piece_shapes(CHECK_NUMEL, 64), directory, shared=False)
    ran = {name: step for name, step in steps.items() if callable(step)}
    for _ in range(CHECK_STEPS):
        for step in ran.values():
            step()
    ref = params["torch-loop"]()
    print(f"max |param - torch-loop's| after {CHECK_STEPS} steps, {CHECK_NUMEL:,} elements:")
    for name in ROWS:
        if name not in ran:
            print(f"  {name:<15} not run: {steps[name]}")
            continue
        diff = max((a - b).abs().max().item() for a, b in zip(params[name](), ref))
        print(f"  {name:<15} {diff:.2e}")
    for cleanup in cleanups:
        cleanup()


def measure(steps: dict, runs: int, threads: int) -> dict[str, tuple[float, float]]:
    """Median (CPU s, wall s) of a step of every row, rounds of one step each in turn."""
    torch.set_num_threads(threads)
    flush = torch.empty(16 << 20)  # 64 MiB: more than the last-level cache
    times = {name: [] for name in steps}
    for r in range(runs + 1):
        for name, step in steps.items():
            flush.fill_(r)
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            if r:  # round 0 warms up
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    return {
        name: tuple(statistics.median(t[i] for t in ts) for i in (0, 1))
        for name, ts in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, nargs="+", default=[1e6, 10e6, 50e6])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="one 200k-element shard, 1 run")
    args = parser.parse_args()
    if args.tiny:
        args.numel, args.runs, args.hidden, args.threads = [2e5], 1, 64, [1]
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"torch {torch.__version__}, load average {load}")
    with tempfile.TemporaryDirectory() as directory:
        check(os.path.join(directory, "check"))
        for numel in args.numel:
            shapes = piece_shapes(int(numel), args.hidden)
            steps, _, cleanups = build_rows(shapes, os.path.join(directory, "run"), shared=True)
            ran = {name: step for name, step in steps.items() if callable(step)}
            for threads in args.threads:
                print(
                    f"\n{int(numel):,} fp32 elements in {len(shapes)} pieces, "
                    f"{threads} thread(s), median of {args.runs} steps"
                )
                results = measure(ran, args.runs, threads)
                fused_cpu, fused_wall = results["torch-fused"]
                print(f"{'row':<15} {'CPU ms':>8} {'/ fused':>8} {'wall ms':>8} {'/ fused':>8}")
                for name in ROWS:
                    if name not in results:
                        print(f"{name:<15} not run: {steps[name]}")
                        continue
                    cpu, wall = results[name]
                    print(
                        f"{name:<15} {cpu * 1e3:>8.1f} {cpu / fused_cpu:>8.2f} "
                        f"{wall * 1e3:>8.1f} {wall / fused_wall:>8.2f}"
                    )
            for cleanup in cleanups:
                cleanup()
    with open("/proc/loadavg") as f:
        print(f"\nload average at the end {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
