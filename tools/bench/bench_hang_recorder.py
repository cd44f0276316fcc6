"""The op recorder and hang watchdog's cost on a training step: on vs off, in one run.

    python tools/bench/bench_hang_recorder.py [--steps 30] [--m 8] [--hidden 512]
    python tools/bench/bench_hang_recorder.py --tiny      # seconds: hidden 64, m 2, 1 step each

Two gloo processes (pipeline stages, one core each) run 1F1B steps of a stack of MLP blocks, each
stage's grads reduced by a ``DistributedDataParallel`` wrapper (a DP group of one: the bucket
bookkeeping runs, the reduction returns at once), alternately with the recorder and the watchdog
(timeout 10 min: it never fires) off and on, so that drift on a busy machine falls on both. Prints
the median step of each and the ratio on / off (1.00 = no cost). Every message, compute action and
bucket of a step is one record when on. Then the cost of one record alone (begin + end of a
pipeline action, recorder on vs off), and what the step's records cost at that rate: a bound the
step ratio, noisy on a shared machine, cannot give.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.distributed.data_parallel import DistributedDataParallel  # noqa: E402
from megalite.core.hang_watchdog import HangWatchdog  # noqa: E402
from megalite.core.op_record import RECORDER  # noqa: E402
from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.core.pipeline_parallel.forward_backward import (  # noqa: E402
    forward_backward_pipelining_1f1b,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk  # noqa: E402
from megalite.core.pipeline_parallel.p2p import P2PCommunicator  # noqa: E402

SEQ, BATCH = 16, 4


class Stage(nn.Module):
    def __init__(self, hidden: int, first: bool, blocks: int = 4):
        super().__init__()
        self.first, self.input_tensor = first, None
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(blocks)
        )

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for block in self.blocks:
            h = h + block(h)
        return h


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda o: ((o * o).mean(), {"loss": (o * o).mean().detach()})


def _worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=timedelta(minutes=10),
    )
    ps = initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    stage = Stage(args.hidden, ps.pp_rank == 0)
    ddp = DistributedDataParallel(
        stage, dp_group=ps.dp_group, bucket_size=args.hidden * args.hidden
    )
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=(SEQ, BATCH, args.hidden),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
    )
    data = [torch.randn(SEQ, BATCH, args.hidden) for _ in range(args.m)]
    store = dist.distributed_c10d._get_default_store()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * args.steps + 2):  # two warmup steps, then off / on alternately
        on = i % 2 == 1
        watchdog = None
        if on:
            RECORDER.enable(rank=rank)
            watchdog = HangWatchdog(RECORDER, timeout_s=600, store=store, rank=rank, world_size=2)
            watchdog.start()
        dist.barrier(group=ps.pp_group)
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        forward_backward_pipelining_1f1b(
            forward_step_func=_forward_step,
            data_iterator=[iter(data)],
            model=[ModelChunk(stage, grad_wrapper=ddp)],
            num_microbatches=args.m,
            p2p=p2p,
            pp_rank=ps.pp_rank,
            pp_size=2,
        )
        ddp.finish_grad_sync()
        took = time.perf_counter() - start
        records = RECORDER.count
        if watchdog is not None:
            watchdog.stop()
            RECORDER.disable()
        if i >= 2:
            times[on].append(took)
    if rank == 0:
        results.put((times, records))
    dist.destroy_process_group()


def _per_record_s(on: bool, n: int) -> float:
    """Seconds per ``begin`` + ``end`` of a pipeline action record, recorder on or off."""
    best = float("inf")
    for _ in range(5):
        if on:
            RECORDER.enable(rank=0)
        start = time.perf_counter()
        for i in range(n):
            RECORDER.end(RECORDER.begin("compute", stage=0, microbatch=i, action="F", chunk=0))
        best = min(best, (time.perf_counter() - start) / n)
        RECORDER.disable()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps with each setting")
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--records", type=int, default=100_000, help="records timed alone")
    p.add_argument("--tiny", action="store_true", help="a smoke run: hidden 64, m 2, 1 step each")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.m, args.hidden, args.records = 1, 2, 64, 1_000
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, init_file, args, results)) for r in (0, 1)]
        for proc in procs:
            proc.start()
        times, records = results.get(timeout=1200)
        for proc in procs:
            proc.join()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_off, per_on = _per_record_s(False, args.records), _per_record_s(True, args.records)
    print(
        f"PP 2 x 1F1B, m {args.m}, hidden {args.hidden}, {args.steps} steps each "
        f"(alternating), rank 0: {records} records per step when on"
    )
    print(f"recorder + watchdog off: median step {off * 1e3:8.2f} ms")
    print(f"recorder + watchdog on:  median step {on * 1e3:8.2f} ms")
    print(f"ratio on / off: {on / off:.3f}")
    print(
        f"one record (begin + end, {args.records} in a row, best of 5): off {per_off * 1e6:.2f} "
        f"us, on {per_on * 1e6:.2f} us; {records} records = "
        f"{100 * records * per_on / off:.4f}% of the median step off"
    )


if __name__ == "__main__":
    main()
