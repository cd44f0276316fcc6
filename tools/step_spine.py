"""The spine of one training step: which of megalite's files run in it, and their lines.

    python tools/step_spine.py                  # TP 2 x PP 2 x DP 2, 8 gloo ranks on CPU
    python tools/step_spine.py --tp 1 --pp 1 --dp 1 --flags "--use-distributed-optimizer"

Each rank builds the run (``pretrain.build_run``: the model chunks, optimizer, data) untraced, then
runs one training iteration under ``sys.setprofile``; every Python function called in it is
recorded by its file. The union over the ranks is the spine: the files a reader must know to follow
one step of that layout. Printed: each file with its line count and the number of its functions
that ran, then the totals. Set-up code (flag parsing, building the mesh and the model) is not in it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 1 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127 --log-interval 1 --eval-iters 0"
)


def _rank(rank: int, world: int, init_file: str, flags: list[str], out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megalite.training.arguments import parse_args
    from megalite.training.config import with_tokenizer
    from megalite.training.forward_step import make_forward_step
    from megalite.training.pretrain import build_run, mesh_for

    cfg = with_tokenizer(parse_args(flags, env=dict(os.environ)))
    ps = mesh_for(cfg.parallel, order=cfg.parallel.rank_order, device=torch.device("cpu"))
    run = build_run(cfg, ps, torch.device("cpu"), resume=False)
    forward_step = make_forward_step(torch.device("cpu"))
    package = str(ROOT / "megalite")
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(package):
                seen.setdefault(path, set()).add(frame.f_code.co_name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run.trainer.train(forward_step, run.train_iter)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    out[rank] = {p: sorted(f) for p, f in seen.items()}
    ps.destroy()
    dist.destroy_process_group()


def spine(tp: int, pp: int, dp: int, extra: list[str]) -> dict[str, set[str]]:
    """File -> the functions of it that ran in one step, over every rank of the layout."""
    world = tp * pp * dp
    flags = [
        *TINY.split(),
        *f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}".split(),
        *extra,
    ]
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), flags, out), nprocs=world)
        merged: dict[str, set[str]] = {}
        for per_rank in out.values():
            for path, functions in per_rank.items():
                merged.setdefault(path, set()).update(functions)
    return merged


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--flags", default="", help="more pretrain_gpt.py flags for the layout")
    args = p.parse_args(argv)
    files = spine(args.tp, args.pp, args.dp, args.flags.split())
    total = 0
    for path in sorted(files):
        lines = Path(path).read_text().count("\n")
        total += lines
        print(f"{lines:5d}  {Path(path).relative_to(ROOT)}  ({len(files[path])} functions ran)")
    print(
        f"spine of one TP {args.tp} x PP {args.pp} x DP {args.dp} step: {len(files)} files, "
        f"{total} lines"
    )


if __name__ == "__main__":
    main()
