"""The planner's traffic model counts every collective and message a real step issues.

For each layout, one step of pretrain_gpt.py's run is logged on every rank
(``measure.comm_log.CommLog``: op, group size, bytes) and held against ``traffic.rank_traffic``
for that rank: the same ops, the same sizes, the same counts. Noise-free: it checks what the
step-time model charges for, whatever the machine's speed. (The alltoall dispatcher's token
all-to-alls carry as many rows as the router sends, so there only their number is compared; the
grad norm's one-number all-reduces are left out, ``_no_scalars``.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megalite.measure.comm_log import CommLog
from megalite.planning.model_state import DTYPE_BYTES
from megalite.planning.predict import Layout
from megalite.planning.search import validate
from megalite.planning.traffic import counts, rank_traffic
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tools.planner.accuracy import build_world_run

MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --hidden-dropout 0 --attention-dropout 0"
).split()
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
UNTIED = ["--untie-embeddings-and-output-weights"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL += ["--recompute-num-layers", "1"]
CASES = [  # (layout, extra model flags, global batch)
    (Layout(dp=2, micro_batch_size=2), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim"), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim_grads"), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim_grads_params"), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim_grads_params"), UNTIED, 8),
    (Layout(tp=2, micro_batch_size=2), [], 4),
    (Layout(tp=2, micro_batch_size=2, sequence_parallel=True), [], 4),
    (Layout(tp=2, micro_batch_size=2, recompute="full"), FULL, 4),
    (Layout(tp=2, micro_batch_size=2, sequence_parallel=True, recompute="full"), FULL, 4),
    (Layout(pp=2, micro_batch_size=1), [], 4),
    (Layout(pp=2, micro_batch_size=1), UNTIED, 4),
    (Layout(pp=2, micro_batch_size=1, schedule="zbv", vp=2), [], 4),
    (Layout(pp=2, micro_batch_size=1, schedule="interleaved-1f1b", vp=2), [], 4),
    (
        Layout(tp=2, micro_batch_size=2, sequence_parallel=True, recompute="full"),
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "3",
        ],
        4,
    ),
    (Layout(cp=2, micro_batch_size=2), [], 4),
    (Layout(cp=2, micro_batch_size=2, recompute="full"), FULL, 4),
    (Layout(dp=2, ep=2, micro_batch_size=2), MOE, 8),
    (Layout(tp=2, ep=2, etp=1, micro_batch_size=2, sequence_parallel=True), MOE, 4),
    (Layout(dp=2, ep=2, micro_batch_size=2), [*MOE, "--moe-token-dispatcher-type", "alltoall"], 8),
]
WORLD4 = [  # groups of 4, and groups that span other axes
    (Layout(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1), [], 4),
    (Layout(tp=2, dp=2, micro_batch_size=1, rung="optim_grads_params"), [], 4),
    (Layout(dp=4, micro_batch_size=1, rung="optim_grads"), [], 8),
    (Layout(pp=2, cp=2, micro_batch_size=1, schedule="dualpipev", vp=2), [], 4),
    (Layout(dp=4, ep=4, micro_batch_size=1), MOE, 8),
]


def _case(cases):
    torch.set_num_threads(1)
    step = make_forward_step(torch.device("cpu"))
    out = []
    for layout, extra, gbs in cases:
        cfg, argv = validate(MODEL, layout, vocab_size=256, global_batch_size=gbs, extra=extra)
        run, ps = build_world_run([*argv, "--train-iters", "4"])
        try:
            run.trainer.step(step, run.train_iter)
            with CommLog() as log:
                run.trainer.step(step, run.train_iter)
            m = gbs // (layout.micro_batch_size * layout.dp)
            e = DTYPE_BYTES[cfg.model.precision_name]
            comms = rank_traffic(cfg.model, layout, pp_rank=ps.rank("pp"), m=m, e=e, cpu=True)
            predicted, measured = counts(comms), log.counts()
        finally:
            ps.destroy()
        if cfg.model.moe_token_dispatcher_type == "alltoall":  # routed rows: the number only
            predicted, measured = (_rows_dropped(c) for c in (predicted, measured))
        predicted, measured = (_no_scalars(c) for c in (predicted, measured))
        out.append((layout.name(), dist.get_rank(), dict(predicted), dict(measured)))
    return out


def _no_scalars(c: Counter) -> Counter:
    """Without the grad norm's one-number all-reduces: which groups reduce it depends on the
    axes (1-3 per step; the model charges ``step_traffic``'s count, milliseconds in all)."""
    return Counter({k: v for k, v in c.items() if not (k[0] == "all_reduce" and k[2] <= 8)})


def _rows_dropped(c: Counter) -> Counter:
    out = Counter()
    for (op, n, nbytes), k in c.items():
        out[(op, n, nbytes if op != "all_to_all" else 0)] += k
    return out


@pytest.mark.parametrize("world, cases", [(2, CASES), (4, WORLD4)], ids=["world2", "world4"])
def test_predicted_traffic_is_what_a_step_sends(world, cases):
    results = run_distributed(_case, world, cases, timeout=600)
    misses = [
        f"{name} rank {rank}: predicted {sorted(p.items())}, logged {sorted(m.items())}"
        for rows in results
        for name, rank, p, m in rows
        if Counter(p) != Counter(m)
    ]
    assert not misses, "\n".join(misses)
