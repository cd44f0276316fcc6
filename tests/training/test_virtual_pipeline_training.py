"""The new schedules in the real training loop: 5 steps equal the single-process run.

TP2 x PP2 x DP2 (8 processes) with sequence parallel and ZeRO-1 (``--use-distributed-optimizer``)
for the interleaved schedule (``--num-virtual-stages-per-pipeline-rank 2``, GPT-2: its tied
embedding on rank 0's first chunk and rank 1's last) and ZB-H1 (Llama, one chunk per rank, weight
grads deferred); then PP2 x DP2 with ZBV and DualPipeV (two chunks per rank in a V: the loss and
the tied embedding both on rank 0, the losses shipped to the last rank for the log) and the
interleaved schedule set by ``--num-layers-per-virtual-pipeline-stage`` without p2p overlap, and
the interleaved schedule with chunks of unequal layer counts (5 layers, 3 on the first rank). The
losses and grad norms equal the oracle's (the same model with ``ParallelState.single()``) to 1e-5
relative, as in test_pipeline_training (fp32: only the order of sums differs).
"""

from __future__ import annotations

from tests.harness import run_distributed
from tests.training.test_pipeline_training import _check, _run

L4 = ("--num-layers", "4")


def test_3d_interleaved_and_zb_h1_with_sp_and_zero1_equal_single_process():
    tp2pp2 = (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--use-distributed-optimizer"
    ).split()
    layouts = [
        ("gpt2", L4, (*tp2pp2, "--num-virtual-stages-per-pipeline-rank", "2")),
        ("llama", L4, (*tp2pp2, "--pipeline-schedule", "zb-h1")),
    ]
    _check(layouts, run_distributed(_run, 8, layouts, timeout=600))


def test_pp2_dp2_zbv_dualpipev_and_interleaved_without_overlap_equal_single_process():
    pp2 = ("--pipeline-model-parallel-size", "2", "--global-batch-size", "16")
    gbs16 = (*L4, "--global-batch-size", "16")
    interleaved = "--num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication"
    uneven = "--num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 3"
    layouts = [
        ("gpt2", gbs16, (*pp2, "--pipeline-schedule", "zbv")),
        ("llama", gbs16, (*pp2, "--pipeline-schedule", "dualpipev")),
        ("llama", gbs16, (*pp2, *interleaved.split())),
        # uneven chunks (Megatron refuses them): 5 layers, rank 0 holds 3 in chunks of 2 and 1,
        # rank 1 holds 2 (1 and 1); the tied embedding on rank 0's first chunk and rank 1's last
        ("gpt2", ("--num-layers", "5", "--global-batch-size", "16"), (*pp2, *uneven.split())),
    ]
    _check(layouts, run_distributed(_run, 4, layouts, timeout=600))
