"""Checkpoint save / load time of a ~125M-parameter GPT-2 vs plain PyTorch, and conversion time.

    python tools/bench/bench_checkpoint.py [--rounds 3] [--bf16] [--dir /tmp/megalite-bench-ckpt]
                                           [--drop-caches]
    python tools/bench/bench_checkpoint.py --tiny --dir DIR   # seconds: 2 layers of h 64, 1 round
    python tools/bench/bench_checkpoint.py --part stall [--rounds 3] [--steps 3] [--writer-nice 19]
                                           [--step-threads N]

The model is GPT-2 small (12 layers, h 768, 12 heads, vocabulary 50257, 1024 positions: 124.4M
parameters) built by megalite's Trainer in one process, after one training step so that AdamW's
moments exist. Each round, in one process and on the same disk:

- save (each round in a rotated order, each into a fresh file or folder):
  ``megalite.checkpoint.save_checkpoint`` through the Trainer's ``checkpoint_io`` (model, fp32
  masters when they are not the parameters themselves, Adam moments, scheduler, RNG, flags;
  fsync; atomic tracker) against the baseline a plain PyTorch user writes:
  ``torch.save({"model": module.state_dict(), "optimizer": adamw.state_dict(), "masters": [fp32
  masters, bf16 only]})`` + fsync, and against ``torch.distributed.checkpoint.save`` of the same
  (the PyTorch-native sharded format);
- load: ``load_checkpoint`` into the trainer (same layout) against ``torch.load`` +
  ``load_state_dict`` of both, and ``torch.distributed.checkpoint.load``;
- ``megalite.load_model`` (the logical, layout-free path every reshard takes);
- conversion: ``export_to_hf`` (megalite -> HF safetensors) and ``import_from_hf`` back.

Stall (``--part stall`` or ``all``): what a save of the same state costs the training loop,
synchronous (the whole ``save_checkpoint``) against ``--async-save``, in one run, round by round:
``--steps`` training steps alone (their median: a step's time without a save), then the async
save's call (``prepare_save``, the copy's plan, the thread's start), the next step (its forward
and backward run beside the copy, its update waits for the rest of it: that wait is reported
apart), more steps while the thread writes (until it is done; at least ``--steps`` in all), and
the finish (the wait for the thread, if it still writes, and the commit). The async figure is
the call + the steps beside the copy and the write - as many steps alone + the finish: every
second the loop lost, the cores the thread took from the steps included. One writer serves every
round, as in a run: its host buffer is made at the first async save and reused.

Medians over ``--rounds``; MB/s = bytes on disk / seconds. Before each timed operation the dirty
pages of the earlier ones are written back (``os.sync``, not timed). Loads read from the page
cache unless ``--drop-caches`` (root; it slows every process on the machine for a moment).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.checkpoint.async_save import WRITER_NICE, AsyncCheckpointWriter  # noqa: E402
from megalite.conversion import export_to_hf, import_from_hf  # noqa: E402
from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.inference import load_model  # noqa: E402
from megalite.training.arguments import parse_args  # noqa: E402
from megalite.training.checkpoint_io import (  # noqa: E402
    finish_async_save,
    load_checkpoint,
    save_checkpoint,
)
from megalite.training.forward_step import make_forward_step  # noqa: E402
from tests.training.common import trainer_and_data  # noqa: E402

GPT2_SMALL = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 128 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 1 --lr 1e-4 "
    "--train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --log-interval 1000"
).split()
TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512".split()


def _dir_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def _drop_caches(enabled: bool) -> None:
    if enabled:
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)


def _timed(fn) -> float:
    os.sync()  # earlier writes' writeback must not slow this one down (not timed)
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _torch_state(trainer) -> dict:
    """Model + AdamW state + the fp32 masters when they are copies (bf16): what resuming needs."""
    opt = trainer.optimizer
    masters = [m for p, m in zip(opt.model_params, opt.master_params) if m is not p]
    return {
        "model": trainer.model[0].module.state_dict(),
        "optimizer": opt.optimizer.state_dict(),
        "masters": masters,
    }


def _torch_save(trainer, path: str) -> None:
    state = _torch_state(trainer)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(trainer, path: str) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    _apply(trainer, state)


def _apply(trainer, state: dict) -> None:
    trainer.model[0].module.load_state_dict(state["model"])
    opt = trainer.optimizer
    opt.optimizer.load_state_dict(state["optimizer"])
    masters = [m for p, m in zip(opt.model_params, opt.master_params) if m is not p]
    with torch.no_grad():
        for m, saved in zip(masters, state["masters"]):
            m.copy_(saved)


def stall(trainer, data, *, rounds: int, steps: int, writer_nice: int) -> dict[str, float]:
    """Medians over ``rounds`` of what a save costs the loop, sync and async (module docstring);
    every part of the async figure is printed per round."""
    forward_step = make_forward_step(torch.device("cpu"))
    times: dict[str, list[float]] = {}

    cpu: list[float] = []  # the process's CPU seconds of each step() (every thread)

    def step() -> float:
        started, cpu_started = time.perf_counter(), time.process_time()
        trainer.step(forward_step, data)
        trainer.result.iteration += 1
        cpu.append(time.process_time() - cpu_started)
        return time.perf_counter() - started

    def add(name: str, value: float) -> None:
        times.setdefault(name, []).append(value)

    # one for the run: its host buffer is kept across saves
    writer = AsyncCheckpointWriter(nice=writer_nice)
    for _ in range(rounds):
        trainer.async_writer = None
        cpu_started = time.process_time()
        add("sync save", _timed(lambda: save_checkpoint(trainer)))
        add("sync save: CPU", time.process_time() - cpu_started)
        cpu.clear()
        alones = [step() for _ in range(steps)]
        alone, alone_cpu = statistics.median(alones), statistics.median(cpu)
        cpu.clear()
        trainer.async_writer = writer
        os.sync()
        waited = writer.copy_wait_seconds
        started = time.perf_counter()
        save_checkpoint(trainer)
        call = time.perf_counter() - started
        beside = [step()]  # the copy runs beside its forward and backward; its update waits
        wait = writer.copy_wait_seconds - waited
        while writer.writing and len(beside) < _MAX_STEPS_BESIDE or len(beside) < steps:
            beside.append(step())  # the write runs beside these
        started = time.perf_counter()
        finish_async_save(trainer)
        finish = time.perf_counter() - started
        add("async: save call", call)
        add("async: wait at the update", wait)
        add("async: step beside the copy, slowdown", beside[0] - wait - alone)
        add("async: steps beside the write, slowdown", sum(beside[1:]) - alone * (len(beside) - 1))
        add("async: finish (wait + commit)", finish)
        add("async save", call + sum(beside) - alone * len(beside) + finish)
        # CPU the process spent beyond the steps alone while the thread ran beside them: an
        # upper bound of the steps' slowdown once the cores are not shared with other work
        extra_cpu = sum(cpu) - alone_cpu * len(cpu)
        add("async: extra CPU of the steps beside", extra_cpu)
        add("async save, CPU bound", call + wait + extra_cpu + finish)
        add("step alone", alone)
        add("step alone: max - min (noise)", max(alones) - min(alones))
        add("steps beside the writer", len(beside))
    trainer.async_writer = None
    buffer = writer.host_buffer
    assert buffer is not None
    print(
        f"async host buffer: {buffer.nbytes / 1e6:.1f} MB, allocated {buffer.allocations} "
        f"time(s) in {rounds} save(s)"
    )
    for name, values in times.items():
        print(f"  {name:42s} rounds: {', '.join(f'{v:.2f}' for v in values)}")
    return {k: statistics.median(v) for k, v in times.items()}


_MAX_STEPS_BESIDE = 50  # a write still going after these is waited for at finish (counted)


def print_stall(med: dict[str, float]) -> None:
    print("stall: seconds a save costs the training loop, medians (async save = its call + the")
    print("steps beside the copy and the write, less as many steps alone + its finish):")
    for name, seconds in med.items():
        print(f"  {name:42s} {seconds:7.2f}")
    load = open("/proc/loadavg").read().split()[0]
    if med["async save"] > 0:
        print(f"ratio: sync / async = {med['sync save'] / med['async save']:.1f}x; load {load}")
    else:  # the steps beside the thread were no slower than the steps alone, within noise
        print(
            f"ratio: async save below the steps' noise (sync {med['sync save']:.2f} s); load {load}"
        )
    bound = med["async save, CPU bound"]
    if bound > 0:  # the steps' slowdown bounded by the extra CPU
        print(f"ratio: sync / async, CPU bound = {med['sync save'] / bound:.1f}x")
    else:
        print("ratio: sync / async, CPU bound: the extra CPU is below the steps' noise")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--dir", default="/tmp/megalite-bench-ckpt")
    p.add_argument("--drop-caches", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a smoke run: 2 layers of h 64, 1 round")
    p.add_argument("--part", choices=("all", "io", "stall"), default="all")
    p.add_argument("--steps", type=int, default=3, help="stall: steps alone per round, at least")
    p.add_argument(
        "--writer-nice",
        type=int,
        default=WRITER_NICE,
        help="stall: the async writer thread's nice value (0: the step's priority)",
    )
    p.add_argument(
        "--step-threads",
        type=int,
        default=0,
        help="torch's intra-op threads of the training steps (default 0: every core). With fewer "
        "than the cores, the writer thread has a core the step leaves idle, as on a GPU host, "
        "whose step runs on the device",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds = 1
    import torch.distributed.checkpoint as dcp

    cores = len(os.sched_getaffinity(0))
    threads = args.step_threads or cores
    if not 1 <= threads <= cores:
        p.error(f"--step-threads {args.step_threads}: need 1 to {cores} (this process's cores)")
    torch.set_num_threads(threads)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    flags = [*GPT2_SMALL, *(TINY if args.tiny else []), *(["--bf16"] if args.bf16 else [])]
    flags += ["--train-iters", "1000"]  # the mock data of the stall's training steps
    cfg = parse_args([*flags, "--save", os.path.join(args.dir, "megalite")], env={})
    trainer, data = trainer_and_data(cfg, ParallelState.single())
    n_params = sum(p.numel() for chunk in trainer.model for p in chunk.module.parameters())
    started = time.perf_counter()
    trainer.step(make_forward_step(torch.device("cpu")), data)  # Adam moments exist
    trainer.result.iteration = 1
    print(
        f"GPT-2 {'(tiny)' if args.tiny else 'small'}: {n_params / 1e6:.1f}M parameters, "
        f"{'bf16' if args.bf16 else 'fp32'}, "
        f"one training step {time.perf_counter() - started:.1f} s"
    )

    if args.part in ("all", "stall"):
        print(f"load average at the start: {open('/proc/loadavg').read().split()[0]}")
        print(
            f"async writer thread at nice {args.writer_nice}; the steps on {threads} intra-op "
            f"thread(s) of {cores} core(s)"
        )
        med = stall(
            trainer, data, rounds=args.rounds, steps=args.steps, writer_nice=args.writer_nice
        )
        print_stall(med)
        if args.part == "stall":
            shutil.rmtree(args.dir, ignore_errors=True)
            return 0
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    megalite_dir = os.path.join(args.dir, "megalite")
    torch_file = os.path.join(args.dir, "torch.pt")
    dcp_dir = os.path.join(args.dir, "dcp")
    hf_dir, back = os.path.join(args.dir, "hf"), os.path.join(args.dir, "from_hf")

    def dcp_save():
        dcp.save(_torch_state(trainer), checkpoint_id=dcp_dir, no_dist=True)

    savers = [
        ("megalite", lambda: save_checkpoint(trainer), megalite_dir),
        ("torch.save", lambda: _torch_save(trainer, torch_file), torch_file),
        ("dcp", dcp_save, dcp_dir),
    ]
    for k in range(args.rounds):
        trainer.result.iteration = k + 1
        for name, save, path in savers[k % 3 :] + savers[: k % 3]:  # rotated: no order bias
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                os.remove(path)
            times.setdefault(f"save {name}", []).append(_timed(save))
        sizes["megalite"] = _dir_bytes(megalite_dir)
        sizes["torch"] = os.path.getsize(torch_file)
        sizes["dcp"] = _dir_bytes(dcp_dir)

        _drop_caches(args.drop_caches)
        times.setdefault("load megalite", []).append(
            _timed(lambda: load_checkpoint(trainer, load_dir=megalite_dir))
        )
        _drop_caches(args.drop_caches)
        times.setdefault("load torch.load", []).append(
            _timed(lambda: _torch_load(trainer, torch_file))
        )
        _drop_caches(args.drop_caches)

        def dcp_load() -> None:
            state = _torch_state(trainer)
            dcp.load(state, checkpoint_id=dcp_dir, no_dist=True)
            _apply(trainer, state)

        times.setdefault("load dcp", []).append(_timed(dcp_load))
        _drop_caches(args.drop_caches)
        times.setdefault("load_model (logical)", []).append(
            _timed(lambda: load_model(megalite_dir))
        )
        times.setdefault("convert megalite -> HF", []).append(
            _timed(lambda: export_to_hf(megalite_dir, hf_dir))
        )
        sizes["HF safetensors"] = _dir_bytes(hf_dir)
        shutil.rmtree(back, ignore_errors=True)
        times.setdefault("convert HF -> megalite", []).append(
            _timed(lambda: import_from_hf(hf_dir, back))
        )

    med = {k: statistics.median(v) for k, v in times.items()}
    cache = "cold page cache" if args.drop_caches else "warm page cache"
    print(f"medians of {args.rounds} rounds ({cache}):")
    for op, seconds in med.items():
        fmt = {"megalite": "megalite", "torch.save": "torch", "torch.load": "torch", "dcp": "dcp"}
        kind = fmt.get(op.split()[-1]) if op.startswith(("save", "load ")) else None
        size = sizes.get(kind) if kind else None
        rate = f"{size / 1e6 / seconds:6.0f} MB/s of {size / 1e6:5.0f} MB" if size else ""
        print(f"  {op:26s} {seconds:7.2f} s  {rate}")
    print(f"  (HF safetensors written: {sizes['HF safetensors'] / 1e6:.0f} MB)")
    print(
        f"ratios: save megalite / torch.save = {med['save megalite'] / med['save torch.save']:.2f}"
        f", / dcp = {med['save megalite'] / med['save dcp']:.2f}; load megalite / torch.load = "
        f"{med['load megalite'] / med['load torch.load']:.2f}, / dcp = "
        f"{med['load megalite'] / med['load dcp']:.2f}"
    )
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
