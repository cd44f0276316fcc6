r"""The planner on published training configurations: does its memory fit, is its MFU in range?

    python tools/bench/planner_published.py            # prints the table of docs/PLANNER.md
    python tools/bench/planner_published.py --tiny     # seconds: the first two rows

Each row is a published run (model, GPUs, layout, batch, and the MFU its authors report, cited in
docs/PLANNER.md), mapped onto the same layout in megalite (interleaving, CP, EP, ZeRO-3 for
FSDP; the note says what still differs). The planner's default efficiency per GPU preset is used,
no calibration on those GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.planning.cluster import preset  # noqa: E402
from megalite.planning.predict import Layout  # noqa: E402
from megalite.planning.presets import MODEL_PRESETS  # noqa: E402
from megalite.planning.search import evaluate  # noqa: E402


def _block(n: int) -> list[str]:
    """The flags that recompute the first ``n`` layers of each chunk."""
    flags = ["--recompute-granularity", "full", "--recompute-method", "block"]
    return [*flags, "--recompute-num-layers", str(n)]


BLOCK2 = _block(2)
PICK = "<pick>"  # in a row's extra flags: the planner picks the interleaving depth and recompute


def _pick(argv: list[str], layout: Layout, cluster, vocab: int, gbs: int):
    """The fastest fitting variant of ``layout``: interleaved with v of 2, 4 or 8 chunks per rank
    (or plain 1F1B), the first N layers of each chunk recomputed (N of 0-4)."""
    best = None
    for v in (1, 2, 4, 8):
        for n in range(5):
            rc = _block(n) if n else []
            sched = dict(schedule="interleaved-1f1b", vp=v) if v > 1 else {}
            variant = replace(layout, **sched)
            c = evaluate([*argv, *rc], variant, cluster, vocab_size=vocab, global_batch_size=gbs)
            if c.error is None and c.fits and (best is None or c.step.mfu > best[0].step.mfu):
                best = (c, c.layout.name() + (f" rc-block{n}" if n else ""))
    return best


# (name, preset, gpu, gpus, layout, global batch, extra model flags, published MFU range %, note)
ROWS = [
    ("Megatron-Core GPT-3 175B", "gpt3-175b", "H100", 128,
     Layout(tp=4, pp=8, dp=4, sequence_parallel=True, rung="optim", micro_batch_size=1,
            schedule="interleaved-1f1b", vp=6),
     256, [], (47.0, 47.0), "as published (VP 6)"),
    ("Llama 3 405B (Meta, 8K GPUs)", "llama3-405b", "H100", 8192,
     Layout(tp=8, pp=16, dp=64, sequence_parallel=True, rung="optim", micro_batch_size=1),
     2048, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7"],
     (38.0, 43.0), "plain 1F1B (Meta's interleaving v unpublished)"),
    ("  same, full recompute", "llama3-405b", "H100", 8192,
     Layout(tp=8, pp=16, dp=64, sequence_parallel=True, rung="optim", micro_batch_size=1,
            recompute="full"),
     2048, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7"],
     (38.0, 43.0), "every layer recomputed"),
    ("  same, block recompute 2", "llama3-405b", "H100", 8192,
     Layout(tp=8, pp=16, dp=64, sequence_parallel=True, rung="optim", micro_batch_size=1),
     2048, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
            *BLOCK2], (38.0, 43.0), "the first 2 layers of each stage recomputed"),
    ("  same, interleaved (planner's pick)", "llama3-405b", "H100", 8192,
     Layout(tp=8, pp=16, dp=64, sequence_parallel=True, rung="optim", micro_batch_size=1),
     2048, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
            PICK], (38.0, 43.0), "Meta interleaved (v unpublished): best v and block recompute"),
    ("Llama 3 405B long context (Meta)", "llama3-405b", "H100", 16384,
     Layout(tp=8, pp=16, dp=8, cp=16, sequence_parallel=True, rung="optim", micro_batch_size=1),
     128, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
           "--seq-length", "131072", "--max-position-embeddings", "131072"],
     (38.0, 38.0), "16M tokens = 128 x 131072"),
    ("  same, block recompute 2", "llama3-405b", "H100", 16384,
     Layout(tp=8, pp=16, dp=8, cp=16, sequence_parallel=True, rung="optim", micro_batch_size=1),
     128, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
           "--seq-length", "131072", "--max-position-embeddings", "131072", *BLOCK2],
     (38.0, 38.0), "the first 2 layers of each stage recomputed"),
    ("  same, interleaved (planner's pick)", "llama3-405b", "H100", 16384,
     Layout(tp=8, pp=16, dp=8, cp=16, sequence_parallel=True, rung="optim", micro_batch_size=1),
     128, ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
           "--seq-length", "131072", "--max-position-embeddings", "131072", PICK],
     (38.0, 38.0), "best v and block recompute"),
    ("Megatron-Core Llama 3 70B", "llama-70b", "H100", 64,
     Layout(tp=4, pp=4, dp=2, cp=2, sequence_parallel=True, rung="optim", micro_batch_size=1),
     128, [], (41.0, 47.0), "as published (CP 2)"),
    ("  same, full recompute", "llama-70b", "H100", 64,
     Layout(tp=4, pp=4, dp=2, cp=2, sequence_parallel=True, rung="optim", micro_batch_size=1,
            recompute="full"),
     128, [], (41.0, 47.0), "CP 2, full recompute"),
    ("torchtitan Llama 3 8B", "llama3-8b", "A100", 64,
     Layout(tp=1, pp=1, dp=64, rung="optim_grads_params", micro_batch_size=1,
            recompute="selective"),
     64, [], (56.3, 58.2), "FSDP = ZeRO-3"),
    ("torchtitan Llama 3 70B", "llama-70b", "A100", 64,
     Layout(tp=8, pp=4, dp=2, sequence_parallel=True, rung="optim", micro_batch_size=1,
            recompute="full"),
     64, [], (50.5, 51.7), "FSDP 64 -> TP8 PP4 DP2"),
    ("  same as ZeRO-3 over 64", "llama-70b", "A100", 64,
     Layout(tp=1, pp=1, dp=64, rung="optim_grads_params", micro_batch_size=1, recompute="full"),
     64, [], (50.5, 51.7), "FSDP = ZeRO-3"),
    ("Megatron-Core Mixtral 8x7B", "mixtral-8x7b", "H100", 64,
     Layout(tp=1, pp=4, dp=16, ep=8, rung="optim", micro_batch_size=1,
            schedule="interleaved-1f1b", vp=8),
     256, [], (47.3, 47.3), "as published (468 TFLOP/s)"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a smoke run: the first two rows")
    args = p.parse_args(argv)
    columns = "run | GPUs | megalite layout | peak GiB / usable | fits | predicted MFU"
    print(f"| {columns} | published MFU | in range | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model, gpu, gpus, layout, gbs, extra, (lo, hi), note in (
        ROWS[:2] if args.tiny else ROWS
    ):
        cluster = preset(gpu, gpus)
        p = MODEL_PRESETS[model]
        argv = [*p["argv"], "--bf16", *(x for x in extra if x != PICK)]
        if PICK in extra:
            c, shown = _pick(argv, layout, cluster, p["vocab_size"], gbs)
        else:
            c = evaluate(argv, layout, cluster, vocab_size=p["vocab_size"], global_batch_size=gbs)
            shown = layout.name() + (" rc-block2" if "block" in extra else "")
        if c.error:
            print(f"| {name} | {gpus} x {gpu} | {shown} | refused: {c.error} |")
            continue
        mfu = c.step.mfu
        inside = lo - 5 <= mfu <= hi + 5
        print(
            f"| {name} | {gpus} x {gpu} | {shown} | {c.peak_bytes / 2**30:.1f} / "
            f"{cluster.usable_bytes / 2**30:.0f} | {'yes' if c.fits else 'NO'} | {mfu:.1f}% | "
            f"{lo:g}-{hi:g}% | {'yes' if inside else 'no'} | {note} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
