"""How early the executor posts its receives on gloo: megalite's step at receive leads 0, 1 and 2
(``P2PCommunicator(receive_lead=...)``; 0 is ``p2p_program``'s own place) against torch's class of
the same schedule, their steps alternating in the same processes.

    python tools/bench/bench_receive_lead.py [--pp 2] [--m 8] [--steps 21] [--schedules 1f1b zbv]
    python tools/bench/bench_receive_lead.py --tiny      # seconds: PP 2, m 4, three steps

The model, shapes and processes are ``bench_pipeline_all.py``'s (8 MLP blocks of h=256 split over
the stages, micro-batch 32, one process and one thread per rank). Per schedule it prints the
median step of each lead and of torch, each lead's step over lead 0's and over torch's. Every
round runs all of them once, in an order rotated from round to round, so that none runs more
often after any other.

Why a lead matters: gloo matches a message by tag, but moves its bytes only once both ends have
posted it. A receive posted after its send has to tell the sender it is ready first, and the
sender's side moves the bytes when its socket thread next gets a core; where the ranks are
computing on every core that can be milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.pipeline_parallel.generators import layout_of  # noqa: E402
from megalite.core.pipeline_parallel.p2p import P2PCommunicator  # noqa: E402
from tools.bench import bench_pipeline_all as common  # noqa: E402

LEADS = (0, 1, 2)
CHUNKS = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def _worker(rank, pp, m, steps, schedules, init_file, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    out = {}
    for schedule in schedules:
        v = CHUNKS.get(schedule, 1)
        layout = layout_of(schedule, pp, v)
        torch.manual_seed(rank)
        n = common.BLOCKS // layout.num_stages
        chunks = [common.Chunk(n, layout.stage(rank, c) == 0) for c in range(layout.num_chunks)]
        model = common._wrapped(chunks)
        runs = {}
        for lead in LEADS:
            p2p = P2PCommunicator(**common._p2p_kwargs(rank, pp), receive_lead=lead)
            args = (schedule, v, model, p2p, m, rank, pp)
            runs[f"lead {lead}"] = lambda args=args: common._megalite(*args)
        runs["torch"] = common._torch_step(schedule, v, chunks, m, rank, pp)
        for step in runs.values():  # warm-up: plans, buffers, torch's shape inference
            common._once(step, chunks)
        samples = {name: [] for name in runs}
        names = list(runs)
        for i in range(steps):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                samples[name].append(common._once(runs[name], chunks))
        out[schedule] = {name: statistics.median(x) for name, x in samples.items()}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b", "zbv"])
    parser.add_argument("--tiny", action="store_true", help="a smoke run: PP 2, m 4, 3 steps")
    args = parser.parse_args()
    if args.tiny:
        args.pp, args.m, args.steps, args.schedules = 2, 4, 3, ["1f1b"]
    unknown = [s for s in args.schedules if s not in common.TORCH_CLASS]
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; one of {sorted(common.TORCH_CLASS)}")
    ctx = common.process_context(args.tiny)
    q = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    work = (args.pp, args.m, args.steps, args.schedules, init_file, q)
    procs = [ctx.Process(target=_worker, args=(r, *work)) for r in range(args.pp)]
    for p in procs:
        p.start()
    out = q.get(timeout=1800)
    for p in procs:
        p.join()
    print(
        f"pp={args.pp} m={args.m}, {common.BLOCKS} MLP blocks of h={common.HIDDEN}, micro-batch "
        f"{common.MICRO_BATCH}, medians of {args.steps} rounds (steps alternating)"
    )
    for schedule, med in out.items():
        base, theirs = med["lead 0"], med["torch"]
        parts = [
            f"lead {lead} {med[f'lead {lead}'] * 1e3:6.1f} ms ({med[f'lead {lead}'] / base:.3f}x "
            f"lead 0, {med[f'lead {lead}'] / theirs:.3f}x torch)"
            for lead in LEADS
        ]
        print(f"  {schedule:17s} " + "; ".join(parts) + f"; torch {theirs * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
