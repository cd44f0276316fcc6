r"""Plan a pretraining job: predicted memory and step time of every layout, ranked.

Usage:
    python tools/plan.py --model llama3-8b --gpus 64 --gpu H100 --global-batch-size 512
    python tools/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 2048 --vocab-size 50257 --gpus 16 --gpu A100 --global-batch-size 256 --explain
    python tools/plan.py --calibrate --calibration-out calib.json     # this machine's figures
    python tools/plan.py --model gpt2-125m --gpus 8 --calibration calib.json ...

Model: ``--model PRESET`` (gpt2-125m ... gpt3-175b, llama2-7b ... llama3-405b, mixtral-8x7b)
or pretrain_gpt.py's model flags with ``--vocab-size``; ``--bf16`` is the
default precision (``--fp16``/``--fp32`` to change). Cluster: ``--gpu H100|H200|A100`` presets,
each figure overridable (``--gpu-memory-gib --peak-tflops --intra-node-gbps --inter-node-gbps``,
bus bandwidth per GPU in GB/s). Prints the top layouts (``--top N``) with a breakdown and the
exact pretrain_gpt.py flags; ``--explain`` says why each rejected (TP, PP, CP, EP, DP) family
was rejected (and why a 2d / 2.5d / 3d tensor-parallel mode beats 1d where it does).
``--offload host|disk`` (repeatable; disk with ``--offload-dir DIR``) also ranks ZeRO-2 with its
optimizer state and ZeRO-3 with its params and optimizer state offloaded, their host and disk bytes
and the time their PCIe / NVMe transfers add (``--calibrate`` measures those links here).
``--jobs N`` spreads a large search over N processes (default: every core).
docs/PLANNER.md explains the model and its measured accuracy.
"""

from __future__ import annotations

import os
import sys

# run as a script: the repository root on the path, for the calibration harness in tools/planner
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.errors import (  # noqa: E402
    ArgumentParser,
    UsageError,
    UserError,
    path_problem,
    run_main,
)
from megalite.planning.cluster import calibrated, load_calibration, preset  # noqa: E402
from megalite.planning.explain import explain  # noqa: E402
from megalite.planning.presets import MODEL_PRESETS, REFUSED_PRESETS  # noqa: E402
from megalite.planning.report import breakdown, ranking_table  # noqa: E402
from megalite.planning.search import SearchSpace, search  # noqa: E402


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tools/plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", help=f"preset: {', '.join([*MODEL_PRESETS, *REFUSED_PRESETS])}")
    p.add_argument("--vocab-size", type=int, help="with model flags (presets know theirs)")
    p.add_argument("--gpu", default="H100", help="H100, H200 or A100 (figures below override)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--gpu-memory-gib", type=float)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--intra-node-gbps", type=float, help="GB/s bus bandwidth per GPU in a node")
    p.add_argument("--inter-node-gbps", type=float, help="GB/s bus bandwidth per GPU across nodes")
    p.add_argument("--efficiency", type=float, help="achieved share of peak in matmuls")
    p.add_argument("--calibration", help="a file written by --calibrate")
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, help="override the model's")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--fp32", action="store_true")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--explain", action="store_true")
    jobs_help = "worker processes for a large search (default: every core)"
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help=jobs_help)
    offload_help = "also rank ZeRO-2 / ZeRO-3 with state offloaded to host memory or NVMe files"
    p.add_argument("--offload", action="append", choices=["host", "disk"], help=offload_help)
    p.add_argument("--offload-dir", help="with --offload disk: the NVMe directory for the files")
    p.add_argument("--calibrate", action="store_true", help="measure this machine, then exit")
    p.add_argument("--calibration-out", default="plan_calibration.json")
    return p


def model_argv(args, rest: list[str]) -> tuple[list[str], int]:
    """(model flags, vocab size) from ``--model`` or the pass-through flags; ValueError if not."""
    if args.model in REFUSED_PRESETS:
        raise ValueError(REFUSED_PRESETS[args.model])
    if args.model is not None:
        if args.model not in MODEL_PRESETS:
            raise ValueError(
                f"--model {args.model} is not a preset; choose one of "
                f"{', '.join(MODEL_PRESETS)} or give the model flags"
            )
        if rest:
            raise ValueError(f"--model {args.model} takes no model flags, got {' '.join(rest)}")
        p = MODEL_PRESETS[args.model]
        argv, vocab = list(p["argv"]), p["vocab_size"]
    else:
        if not rest:
            raise ValueError(
                "give --model PRESET or pretrain_gpt.py's model flags (--num-layers ...)"
            )
        if args.vocab_size is None:
            raise ValueError("model flags need --vocab-size N (the tokenizer's vocabulary)")
        argv, vocab = list(rest), args.vocab_size
    if args.seq_length is not None:
        if "--seq-length" in argv:
            i = argv.index("--seq-length")
            argv[i + 1] = str(args.seq_length)
        else:
            argv += ["--seq-length", str(args.seq_length)]
        if "--max-position-embeddings" in argv:
            i = argv.index("--max-position-embeddings")
            argv[i + 1] = str(max(int(argv[i + 1]), args.seq_length))
    if not args.fp32:
        argv.append("--fp16" if args.fp16 else "--bf16")
    return argv, vocab


def check_writable_file(path: str, *, flag: str, what: str) -> None:
    """Refuse (``UserError``, naming ``flag`` and ``path``) a file this process could not write:
    its folder is created as the write would need, the file opened for appending (and removed
    again when it did not exist)."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a folder; give a file path for the {what}")
    folder = os.path.dirname(os.path.abspath(path))
    existed = os.path.exists(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "ab"):  # not truncated: an existing file keeps its contents
            pass
    except OSError as e:
        where = "cannot create its folder" if not os.path.isdir(folder) else "cannot write it"
        raise UserError(
            f"{flag} {path}: {where} ({path_problem(e)}); give a writable path for the {what}"
        ) from None
    if not existed:
        os.remove(path)


def main(argv: list[str] | None = None, out=None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(lambda a: _main(a, out or sys.stdout), argv)


def _main(argv: list[str] | None, out) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.calibrate:
        # the outputs first: a calibration takes minutes, then has nowhere to go
        check_writable_file(args.calibration_out, flag="--calibration-out", what="calibration")
        # the harness builds real runs (the training loop, data): imported only to calibrate,
        # so a search (and each of its worker processes) starts without them
        from tools.planner.calibrate import calibrate_and_save

        calibrate_and_save(args.calibration_out, out=out)
        return 0
    try:
        margv, vocab = model_argv(args, rest)
        cluster = preset(
            args.gpu,
            args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            peak_tflops=args.peak_tflops,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            efficiency=args.efficiency,
        )
        if args.calibration:
            cluster = calibrated(cluster, load_calibration(args.calibration))
        gbs = args.global_batch_size or cluster.gpus
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        offload = tuple(args.offload or ())
        if "disk" in offload and args.offload_dir is None:
            raise ValueError("--offload disk needs --offload-dir DIR (where the files would go)")
        space = SearchSpace(offload=offload, offload_dir=args.offload_dir)
        result = search(
            margv, cluster, vocab_size=vocab, global_batch_size=gbs, jobs=args.jobs, space=space
        )
    except ValueError as e:  # the flags' values, each named in the message
        raise UsageError(str(e).splitlines()[0]) from None
    print(
        f"{args.model or 'model'} on {cluster.gpus} x {cluster.name} "
        f"({cluster.gpu_memory_gib:g} GiB, {cluster.peak_tflops:g} TFLOP/s peak, efficiency "
        f"{cluster.efficiency:.2f}), global batch {gbs}: {len(result.ranked)} layouts fit, "
        f"{len(result.rejected)} rejected, {result.dominated} not evaluated (they fit with less "
        "recompute)",
        file=out,
    )
    if not result.ranked:
        print("no layout fits; --explain says why", file=out)
    for line in ranking_table(result.ranked, args.top):
        print(line, file=out)
    for c in result.ranked[: args.top]:
        print("", file=out)
        for line in breakdown(c):
            print(line, file=out)
    if args.explain:
        print("\nwhy each (TP, PP, DP, CP, EP) family ranks where it does:", file=out)
        for line in explain(result, cluster):
            print("  " + line, file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
