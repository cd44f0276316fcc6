"""Bigger than RAM: a GPT whose fp32 params, grads and Adam state (16 bytes per parameter) live in
files trains on one process with ZeRO-3, streamed through bounded host buffers (ZeRO-Infinity).

    python tools/bench/bench_infinity.py                  # 3.33B params: 53 GB of files
    python tools/bench/bench_infinity.py --tiny           # seconds: CI's smoke run
    python tools/bench/bench_infinity.py --layers 24 --hidden 1024 --host-memory-mb 64
    python tools/bench/bench_infinity.py --dir /nvme/scratch --steps 3 --drop-cache

The set-up: world 1 (ZeRO-3 semantics on a DP group of one: every unit gathered from its shard
before use and released after), GPT-2 family (learned positions, LayerNorm, GELU, tied
embeddings), fp32, dropout 0, one micro-batch of ``--micro-batch`` x ``--seq`` tokens per step,
AdamW with clipping at 1.0 (``--recompute``: full activation recomputation, layer by layer).
The model is built on the meta device and each unit (the embedding, a layer, the final norm) is
filled from a twin built alone on the CPU with the keyed initialisation
(``megalite.core.distributed.deferred_init``), so the whole model never exists in memory. Params
(``param/``, the optimizer's master file too), reduced grads (``.grad``, beside them) and Adam's
two moments (``optim/``) are files under ``--dir`` (default: a new directory under /tmp), read and
written through ``--host-memory-mb`` MiB of staging per stream; the files and the directory are
removed at the end. Free disk is checked first.

Printed: the parameter count and the bytes of state on disk; per step the loss, seconds, and the
bytes read and written, from ``/proc/self/io`` (``rchar``/``wchar``: what the process asked of
the files; ``read_bytes``/``write_bytes``: what reached the block layer, page-cache misses and
writeback), and the disk throughput this achieves (block bytes / step time: a lower bound, the
step also computes); the same disk's throughput by ``dd`` in the same run (``oflag=direct`` /
``iflag=direct``: the page cache bypassed, a file of ``--dd-mb``); the process's peak RSS and its
share of MemTotal. ``--drop-cache``: before each step, the offload files are flushed and dropped
from the page cache (``fdatasync`` + ``posix_fadvise(DONTNEED)``, this run's files only), so a
state that would fit the page cache is still read from the disk; without it a state smaller than
the free memory is mostly read from the cache, and the throughput says so.

The check of the first-step loss, computed another way. A separate process builds the same
architecture as one-layer pipeline stages (``GPTModel(layer_range=(i, i + 1))``: the first with
the embedding, the last with the final norm and the output layer, whose tied weight is a copy
keyed like the embedding's), each a normal CPU build with the keyed initialisation, alive alone,
and runs the same batch through them in turn, passing the hidden states as a pipeline would
(``set_input_tensor``). No ZeRO, no files, no meta build, no twins, no flat buckets: it checks that
the files hold the right values and the offloaded forward computes the model. Its loss must equal
the first step's within ``--check-rel`` (fp32, the same operations: expected equal), else the
script exits 1; so do non-finite losses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.distributed import ParamOffloadSpec  # noqa: E402
from megalite.core.distributed.deferred_init import release_params  # noqa: E402
from megalite.core.optimizer import OffloadSpec  # noqa: E402
from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.training.components import wrap_and_build_optimizer  # noqa: E402

GIB = 2**30
FULL = {"layers": 28, "hidden": 3072, "heads": 24, "vocab": 50257, "seq": 256}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 500, "seq": 32}
STATE_BYTES = 16  # fp32 param + grad + exp_avg + exp_avg_sq per parameter


def gpt_config(args) -> GPTConfig:
    return GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        seed=args.seed,
        recompute_granularity="full" if args.recompute else None,
        recompute_method="uniform" if args.recompute else None,
    )


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels # [micro_batch, seq]: the same batch every step."""
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dd_throughput(directory: str, mib: int) -> dict:
    """Bytes/s of ``dd`` writing then reading a ``mib`` MiB file in ``directory``: O_DIRECT, or
    (a file system that refuses it) buffered with an fsync after the write and the file's pages
    dropped before the read; ``mode`` says which."""
    path = os.path.join(directory, "dd.bench")
    out = {"mode": "O_DIRECT"}
    runs = {
        "O_DIRECT": (["oflag=direct", "conv=fsync"], ["iflag=direct"]),
        "buffered, fsync + fadvise(DONTNEED)": (["conv=fsync"], []),
    }
    try:
        for mode, (write_flags, read_flags) in runs.items():
            try:
                for kind, argv in (
                    ("write", ["if=/dev/zero", f"of={path}", *write_flags]),
                    ("read", [f"if={path}", "of=/dev/null", *read_flags]),
                ):
                    if kind == "read" and not read_flags:
                        drop_cache([path])
                    t = time.perf_counter()
                    cmd = ["dd", *argv, "bs=1M", f"count={mib}"]
                    subprocess.run(cmd, check=True, capture_output=True)
                    out[kind] = mib * 2**20 / (time.perf_counter() - t)
                out["mode"] = mode
                return out
            except subprocess.CalledProcessError:
                continue
        raise SystemExit(f"bench_infinity: dd failed in {directory}")
    finally:
        if os.path.exists(path):
            os.remove(path)


def drop_cache(paths: list[str]) -> None:
    """Flush ``paths`` to disk and drop their pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reference_loss(args) -> float:
    """The first-step loss layer by layer (module docstring), in this process."""
    cfg, ps = gpt_config(args), ParallelState.single()
    tokens, labels = batch(args)
    hidden = None
    for i in range(cfg.num_layers):
        first, last = i == 0, i == cfg.num_layers - 1
        stage = GPTModel(cfg, ps, pre_process=first, post_process=last, layer_range=(i, i + 1))
        stage.set_input_tensor(hidden)
        with torch.no_grad():
            hidden = stage(tokens, None, labels if last else None)
        del stage
    return float(hidden.mean())


def reference_in_subprocess(args) -> float:
    argv = [sys.executable, __file__, "--reference", *sys.argv[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the reference process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["loss"]


def train(args, directory: str) -> dict:
    cfg, ps = gpt_config(args), ParallelState.single()
    host_bytes = int(args.host_memory_mb * 2**20)
    module = GPTModel(cfg, ps, device=torch.device("meta"))
    release_params(module, torch.device("cpu"))
    t = time.perf_counter()
    model, opt = wrap_and_build_optimizer(
        module,
        ps,
        strategy="optim_grads_params",
        param_offload=ParamOffloadSpec(directory=f"{directory}/param", host_bytes=host_bytes),
        grad_offload=True,
        grad_files=True,
        offload=OffloadSpec(directory=f"{directory}/optim", host_bytes=host_bytes),
        lr=1e-4,
        weight_decay=0.01,
        clip_grad=1.0,
    )
    build_s = time.perf_counter() - t
    files = [f.path for f in (*model.param_store.files, *model.param_store.grad_files)]
    files += [p for sb in opt.buffers for p in sb.store.own_paths]
    disk = sum(os.path.getsize(p) for p in files)
    tokens, labels = batch(args)
    steps = []
    try:
        for _ in range(args.steps):
            if args.drop_cache:
                drop_cache(files)
            io, t = proc_io(), time.perf_counter()
            model.zero_grad_buffer()
            opt.zero_grad()
            loss = model(tokens, None, labels).mean()
            loss.backward()
            model.finish_grad_sync()
            backward = time.perf_counter() - t
            _, norm, _ = opt.step()
            seconds = time.perf_counter() - t
            after = proc_io()
            moved = {k: after[k] - io[k] for k in io}
            steps.append({"loss": loss.item(), "norm": float(norm), "s": seconds, **moved})
            read, written = size(moved["rchar"]), size(moved["wchar"])
            print(
                f"step {len(steps)}: loss {loss.item():.6f}  grad norm {float(norm):.4f}  "
                f"{seconds:.1f} s (forward + backward {backward:.1f}, optimizer "
                f"{seconds - backward:.1f})  read {read} ({size(moved['read_bytes'])} from disk)  "
                f"written {written} ({size(moved['write_bytes'])} to disk)",
                flush=True,
            )
    finally:
        opt.remove_offload_files()
        model.remove_offload_files()
    return {"build_s": build_s, "disk": disk, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dir", default=None, help="where the files go (default: under /tmp)")
    parser.add_argument("--host-memory-mb", type=float, default=64.0)
    parser.add_argument("--recompute", action="store_true", help="full recompute, 1 layer")
    parser.add_argument("--dd-mb", type=int, default=4096)
    parser.add_argument("--drop-cache", action="store_true")
    parser.add_argument("--check-rel", type=float, default=1e-5)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.steps, args.host_memory_mb, args.dd_mb = 1, 1.0, 1
    if args.reference:
        print(json.dumps({"loss": reference_loss(args)}))
        return

    module = GPTModel(gpt_config(args), ParallelState.single(), device=torch.device("meta"))
    params = sum(p.numel() for p in module.parameters())
    del module
    made = args.dir is None
    directory = tempfile.mkdtemp(prefix="bench_infinity_") if made else args.dir
    os.makedirs(directory, exist_ok=True)
    need = STATE_BYTES * params + args.dd_mb * 2**20
    free = shutil.disk_usage(directory).free
    if free < need * 1.05:
        raise SystemExit(
            f"bench_infinity: {directory} has {free / GIB:.1f} GiB free, the run needs "
            f"{need * 1.05 / GIB:.1f} GiB ({params:,} params x {STATE_BYTES} B + the dd file + 5%)"
        )
    ram = mem_total()
    print(
        f"GPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}: "
        f"{params:,} params, {size(STATE_BYTES * params)} of fp32 state "
        f"({STATE_BYTES * params / ram:.2f}x this machine's {ram / GIB:.1f} GiB of RAM); "
        f"files in {directory}; host staging {args.host_memory_mb:g} MiB per stream",
        flush=True,
    )
    try:
        t = time.perf_counter()
        want = reference_in_subprocess(args)
        print(
            f"reference loss (one-layer stages, another process): {want:.6f} "
            f"({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
        dd = dd_throughput(directory, args.dd_mb)
        result = train(args, directory)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    steps = result["steps"]
    rss = peak_rss()
    print(
        f"build (meta + unit-by-unit init into the files): {result['build_s']:.1f} s; "
        f"state on disk {result['disk'] / GIB:.2f} GiB"
    )
    print(f"peak RSS {size(rss)} = {100 * rss / ram:.1f}% of MemTotal")
    print(
        f"dd ({dd['mode']}, {args.dd_mb} MiB): write {dd['write'] / 2**20:.0f} MiB/s, "
        f"read {dd['read'] / 2**20:.0f} MiB/s"
    )
    for i, s in enumerate(steps, 1):
        rate = (s["read_bytes"] + s["write_bytes"]) / s["s"]
        asked = (s["rchar"] + s["wchar"]) / s["s"]
        print(
            f"step {i}: {s['s']:.1f} s; block I/O {rate / 2**20:.0f} MiB/s "
            f"(file I/O asked {asked / 2**20:.0f} MiB/s; dd read+write mean "
            f"{(dd['read'] + dd['write']) / 2 / 2**20:.0f} MiB/s)"
        )
    first = steps[0]["loss"]
    rel = abs(first - want) / abs(want)
    print(
        f"first-step loss {first:.6f} vs reference {want:.6f}: relative difference {rel:.2e} "
        f"(limit {args.check_rel:g})"
    )
    finite = all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    if rel > args.check_rel or not finite:
        raise SystemExit(f"check failed: relative difference {rel:.2e}, finite losses {finite}")


if __name__ == "__main__":
    main()
