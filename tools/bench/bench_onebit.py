"""Convergence and wall time of the compressed optimizers against their full-precision bases, at
DP 4 on CPU/gloo: adam vs onebit-adam vs zero-one-adam, lamb vs onebit-lamb.

    python tools/bench/bench_onebit.py --data-dir runs/quickstart-X   # the quickstart's corpus
    python tools/bench/bench_onebit.py                                 # builds the corpus itself
    python tools/bench/bench_onebit.py --tiny        # mock data, adam vs onebit-adam in-process
    python tools/bench/bench_onebit.py --corpus /tmp/onebit-corpus-X --bases adam   # one pair
    python tools/bench/bench_onebit.py --corpus C --curves /tmp/curves.json  # reuse the curves
    python tools/bench/bench_onebit.py --corpus C --bases adam --reference-noise  # seed noise
    python tools/bench/bench_onebit.py --corpus C --bases lamb --lamb-lr 1e-2 \
        --onebit-lamb-factor-max 1 --onebit-lamb-factor-min 1   # 1-bit LAMB without the factor
    python tools/bench/bench_onebit.py --corpus C --freeze 50 --micro-batches 1 --lamb-lr 1e-3
                                                      # the set-up of the earlier runs: batch 8

Each optimizer trains the same small GPT (``pretrain``, the real loop) from the same seed on the
same data, one run after another, in a fresh 4-rank world each. The corpus is the quickstart's
(``scripts/quickstart.sh``: the standard library's .py files, a SentencePiece tokenizer of 4096
pieces, Megatron's .bin/.idx); ``--data-dir`` reuses a quickstart run's output, otherwise it is
built into a temporary folder with the same tools. Printed per compressed optimizer: the largest
relative gap of its loss to its base's after the warm-up (signed; ``loss_gaps``), at every step
and at every logged step of Megatron's ``--log-interval`` (the mean loss of the interval's steps;
the issue's criterion reads either way, so both are printed), the wall time per step
against the base's in the same run (including start-up; the machine's load shows in both), and
the bytes per step on the DP group as the planner counts them (``bus_factor``) with the time
they take on a 25 Gb/s inter-node link. The loss curves go to an SVG (``--plot``). ``--curves``
names a JSON file of curves and walls, keyed by the flags: a base (adam, lamb) found there is not
run again (its losses are deterministic and its code is not what is measured), and each finished
run is added to it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from megalite.core.distributed.compressed_allreduce import wire_bytes  # noqa: E402
from megalite.core.optimizer.sketched_norm import sketch_size  # noqa: E402
from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.planning.cluster import bus_factor  # noqa: E402
from megalite.training.arguments import parse_args, with_tokenizer  # noqa: E402
from megalite.training.components import build_model  # noqa: E402
from megalite.training.pretrain import pretrain  # noqa: E402

DP = 4
LINK_GBPS = 25.0
PAIRS = {"adam": ("onebit-adam", "zero-one-adam"), "lamb": ("onebit-lamb",)}
COLORS = {
    "adam": "#1f77b4",
    "onebit-adam": "#ff7f0e",
    "zero-one-adam": "#2ca02c",
    "lamb": "#d62728",
    "onebit-lamb": "#9467bd",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(a: argparse.Namespace, base: str = "adam", seed: int | None = None) -> list[str]:
    """The run's flags but the optimizer's; the LAMB pair trains at ``--lamb-lr``."""
    lr = a.lamb_lr if base == "lamb" else a.lr
    warmup = a.freeze // 4 if a.lr_warmup is None else a.lr_warmup
    flags = f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 "
    flags += f"--seq-length {a.seq} --max-position-embeddings {a.seq} --micro-batch-size 2 "
    flags += f"--global-batch-size {2 * DP * a.micro_batches} --train-iters {a.steps} "
    flags += f"--lr {lr} --min-lr 0 "
    flags += f"--lr-warmup-iters {warmup} --lr-decay-style cosine --weight-decay 0.01 "
    flags += f"--log-interval 1000000 --eval-iters 0 --seed {a.seed if seed is None else seed} "
    flags += "--hidden-dropout 0 --attention-dropout 0 --clip-grad 1.0"
    return flags.split()


def _optimizer_flags(name: str, a: argparse.Namespace) -> list[str]:
    flags = ["--optimizer", name, "--onebit-freeze-step", str(a.freeze)]
    flags += [
        "--zero-one-var-freeze-step",
        str(a.freeze),
        "--zero-one-local-step-scaler",
        "1000000",
    ]
    if name == "onebit-lamb":  # the framework's defaults unless given
        for knob in ("max", "min", "threshold"):
            value = getattr(a, f"onebit_lamb_factor_{knob}")
            if value is not None:
                flags += [f"--onebit-lamb-factor-{knob}", str(value)]
    return flags


def _rank(rank: int, port: int, flags: list[str], out) -> None:
    env = {"RANK": str(rank), "WORLD_SIZE": str(DP), "LOCAL_RANK": str(rank)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(DP))
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    started = time.perf_counter()
    result = pretrain(with_tokenizer(parse_args(flags, env=env)), env=env)
    if rank == DP - 1:
        out.put((result.losses, time.perf_counter() - started))


def run(flags: list[str], *, world: int = DP) -> tuple[list[float], float]:
    """(losses, wall seconds) of one pretrain run: DP 4 in spawned ranks, or (``world`` 1, the
    smoke run) in this process."""
    if world == 1:
        started = time.perf_counter()
        result = pretrain(with_tokenizer(parse_args(flags, env={})), env={})
        return result.losses, time.perf_counter() - started
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, flags, out)) for r in range(DP)]
    for p in procs:
        p.start()
    losses, wall = out.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return losses, wall


def build_corpus(folder: str) -> list[str]:
    """The quickstart's corpus and tokenizer in ``folder``; returns the data flags."""
    py = sys.executable
    jsonl, prefix = f"{folder}/stdlib.jsonl", f"{folder}/stdlib"
    for cmd in (
        [py, "tools/make_stdlib_corpus.py", "--output", jsonl],
        [py, "tools/train_tokenizer.py", "--input", jsonl, "--model-prefix", prefix]
        + "--vocab-size 4096 --input-sentence-size 200000 --num-threads 2".split(),
        [py, "tools/preprocess_data.py", "--input", jsonl, "--output-prefix", prefix]
        + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{prefix}.model"]
        + ["--append-eod"],
    ):
        subprocess.run(cmd, check=True, cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    return data_flags(f"{prefix}_text_document", f"{prefix}.model")


def data_flags(data_path: str, tokenizer: str) -> list[str]:
    return ["--data-path", data_path, "--split", "98,2,0"] + [
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        tokenizer,
    ]


@dataclass(frozen=True)
class Gaps:
    """Relative loss gaps ``(loss - base) / base`` after the warm-up (signed: below 0 is lower
    than the base's loss)."""

    worst: float  # the largest in size, with its sign
    worst_step: int  # 1-based
    over: int  # how many exceed 2% in size
    count: int
    last: float


def loss_gaps(curve: list[float], base: list[float], *, freeze: int, interval: int = 1) -> Gaps:
    """Gaps at every logged step after ``freeze``: with ``interval`` 1 the per-step losses; else
    Megatron's logged loss, the mean of the ``interval`` steps up to each multiple of it (a
    window that starts inside the warm-up is not counted)."""
    steps = [k for k in range(interval, len(curve) + 1, interval) if k - interval >= freeze]
    if not steps:
        raise ValueError(f"no logged step after the warm-up (freeze {freeze}, interval {interval})")
    gaps = []
    for k in steps:
        x, y = sum(curve[k - interval : k]) / interval, sum(base[k - interval : k]) / interval
        gaps.append((x - y) / y)
    worst = max(range(len(gaps)), key=lambda i: abs(gaps[i]))
    over = sum(abs(g) > 0.02 for g in gaps)
    return Gaps(gaps[worst], steps[worst], over, len(gaps), gaps[-1])


def write_svg(path: str, curves: dict[str, list[float]], freeze: int) -> None:
    """The loss curves as a plain SVG line chart (no plotting library needed)."""
    w, h, pad = 720, 420, 50
    values = [v for c in curves.values() for v in c]
    lo, hi = min(values), max(values)
    steps = max(len(c) for c in curves.values())

    def xy(i: int, v: float) -> str:
        x = pad + (w - 2 * pad) * i / max(steps - 1, 1)
        y = h - pad - (h - 2 * pad) * (v - lo) / max(hi - lo, 1e-9)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">']
    parts.append(f'<rect width="{w}" height="{h}" fill="white"/>')
    fx = pad + (w - 2 * pad) * freeze / max(steps - 1, 1)
    parts.append(f'<line x1="{fx}" y1="{pad}" x2="{fx}" y2="{h - pad}" stroke="#999"/>')
    parts.append(f'<text x="{fx + 4}" y="{pad + 12}" font-size="11">freeze</text>')
    for k, (name, c) in enumerate(curves.items()):
        points = " ".join(xy(i, v) for i, v in enumerate(c))
        color = COLORS.get(name, "black")
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1" points="{points}"/>')
        parts.append(f'<text x="{w - 160}" y="{pad + 14 * k}" fill="{color}">{name}</text>')
    parts.append(f'<text x="{pad}" y="{h - 15}" font-size="11">step 1..{steps}; loss {lo:.2f}')
    parts.append(f"..{hi:.2f} (DP {DP}, gloo, CPU)</text></svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="mock data, a few steps: a smoke run")
    p.add_argument("--data-dir", help="a quickstart run's output (data/ and tokenizer/)")
    p.add_argument("--corpus", help="a folder an earlier run of this bench built (reused)")
    p.add_argument("--bases", default="adam,lamb", help="which pairs to run: adam, lamb or both")
    p.add_argument("--steps", type=int, default=300)
    # the defaults: what a DeepSpeed user sets up (the variance frozen once it has settled, after
    # the lr warm-up; LAMB at a rate it trains at; enough samples per rank that the momentum each
    # compresses is not mostly noise), measured in docs/PERFORMANCE.md against the earlier ones
    p.add_argument("--freeze", type=int, default=100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--lamb-lr",
        type=float,
        default=1e-2,
        help="the LAMB pair's lr; LAMB steps each tensor by about lr * |w|, so it "
        "trains at a larger lr than Adam",
    )
    p.add_argument(
        "--lr-warmup",
        type=int,
        help="Megatron's --lr-warmup-iters (default: a quarter of the freeze)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches of 2 per rank per step (the global batch is 8 times this): each "
        "rank's momentum, what the compression sends, then averages more samples",
    )
    for knob, help_ in (
        ("max", "upper bound on the factor of the frozen trust ratio"),
        ("min", "lower bound on the factor"),
        ("threshold", "the factor's largest relative change per step"),
    ):
        p.add_argument(f"--onebit-lamb-factor-{knob}", type=float, help=f"1-bit LAMB: {help_}")
    p.add_argument(
        "--reference-noise",
        action="store_true",
        help="also run each base with --seed + 1 and print its gaps to the base: the noise a "
        "change of seed alone gives, the scale the 2%% criterion is read against",
    )
    p.add_argument("--log-interval", type=int, default=10, help="Megatron's: the logged gap")
    p.add_argument("--plot", default="docs/img/onebit_curves.svg")
    p.add_argument("--curves", help="JSON file of finished runs: reused, and extended")
    a = p.parse_args()
    if a.tiny:
        a.steps, a.freeze, a.layers, a.hidden, a.seq = 3, 1, 1, 32, 16
        a.micro_batches = 1
        a.log_interval = 1
        data = "--mock-data --tokenizer-type NullTokenizer --vocab-size 127".split()
    elif a.data_dir:
        d = a.data_dir
        data = data_flags(f"{d}/data/stdlib_text_document", f"{d}/tokenizer/stdlib.model")
    elif a.corpus:
        data = data_flags(f"{a.corpus}/stdlib_text_document", f"{a.corpus}/stdlib.model")
    else:
        folder = tempfile.mkdtemp(prefix="onebit-corpus-")
        print(f"corpus: {folder} (reuse it with --corpus)")
        data = build_corpus(folder)
    curves, walls = {}, {}
    saved = {}
    if a.curves and os.path.exists(a.curves):
        with open(a.curves) as f:
            saved = json.load(f)
    bases = a.bases.split(",")
    unknown = sorted(set(bases) - set(PAIRS))
    if unknown:
        raise SystemExit(f"--bases {a.bases}: {unknown} unknown; choose from {sorted(PAIRS)}")
    pairs = {"adam": ("onebit-adam",)} if a.tiny else {b: PAIRS[b] for b in bases}
    for base, compressed in pairs.items():
        names = [base, *compressed]
        if a.reference_noise:
            names.append(f"{base}-seed{a.seed + 1}")
        for name in names:
            optimizer, seed = name.split("-seed")[0], None
            if name != optimizer:
                seed = a.seed + 1
            flags = [*_model_flags(a, base, seed), *data, *_optimizer_flags(optimizer, a)]
            key = " ".join(flags)
            if optimizer in PAIRS and key in saved:  # a base: its code is not what is measured
                losses, wall = saved[key]
            else:
                losses, wall = run(flags, world=1 if a.tiny else DP)
                if a.curves:
                    saved[key] = (losses, wall)
                    with open(a.curves, "w") as f:
                        json.dump(saved, f)
            curves[name], walls[name] = losses, wall / a.steps
            print(f"{name:>14}: final loss {losses[-1]:.4f}, {1e3 * walls[name]:.1f} ms/step")
    numel = _numel(a, data)
    fp32 = bus_factor("all_reduce", DP) * 4 * numel
    # the compressed all-reduce, and the clip's sketch of the mean grad (--clip-grad 1.0)
    one = bus_factor("all_to_all", DP) * wire_bytes(numel, DP)
    one += bus_factor("all_reduce", DP) * 4 * (sketch_size(numel) + 1)
    link = LINK_GBPS * 1e9 / 8
    print(f"DP-group bytes per step ({numel} params, on the wire): fp32 all-reduce {fp32:.0f}, ")
    print(f"  compressed {one:.0f} ({fp32 / one:.1f}x fewer); at {LINK_GBPS:.0f} Gb/s: ")
    print(f"  {1e3 * fp32 / link:.2f} ms vs {1e3 * one / link:.3f} ms per step")
    for base, compressed in pairs.items():
        for name in (*compressed, *([f"{base}-seed{a.seed + 1}"] if a.reference_noise else [])):
            ratio = walls[name] / walls[base]
            print(f"{name:>14} vs {base}: wall per step {ratio:.2f}x; loss gap after warm-up:")
            for interval in sorted({1, a.log_interval}):
                g = loss_gaps(curves[name], curves[base], freeze=a.freeze, interval=interval)
                what = "per step" if interval == 1 else f"logged every {interval} (mean)"
                print(
                    f"{'':>16}{what}: largest {100 * g.worst:+.2f}% (step {g.worst_step}), "
                    f"{g.over} of {g.count} over 2%, at the last step {100 * g.last:+.2f}%"
                )
    if a.plot and not a.tiny:
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        write_svg(a.plot, curves, a.freeze)
        print(f"curves: {a.plot}")


def _numel(a: argparse.Namespace, data: list[str]) -> int:
    """Parameters of the model the runs train (one replica)."""
    cfg = with_tokenizer(parse_args([*_model_flags(a), *data], env={}))
    model = build_model(cfg, ParallelState.single(), device=torch.device("cpu"), rng_tracker=None)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
