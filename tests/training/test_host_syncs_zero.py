"""No device -> host read between log intervals, for the paths tests/training/test_host_syncs.py
does not cover: ZeRO-2 and ZeRO-3 with overlapped grad reduce-scatter and param all-gather,
optimizer offload to the host, context parallelism (ring), and the pipeline schedules that hand
the loss from another rank to the last (V layouts).

One spawned world of 2 runs every case (``--log-interval 4``, 8 iterations, reads attributed to
the iteration whose step ran last; iterations 4 and 8 read the interval and are not checked). MoE
is not here: the dropless all-to-all reads its split sizes on the host once per MoE layer and
micro-batch by design (docs/CUDA_AUDIT.md).
"""

from __future__ import annotations

from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.test_host_syncs import LOGGED, _reads_per_iteration

DP2_CASES = {
    "zero2-overlap": ["--zero-stage", "2", "--overlap-grad-reduce", "--bf16"],
    "zero3-overlap": ["--zero-stage", "3", "--overlap-grad-reduce"],
    "zero1-offload-half": [
        "--use-distributed-optimizer",
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "0.5",
        "--bf16",
    ],
}
CP2_CASES = {"cp2-ring": ["--context-parallel-size", "2"]}
PP2_CASES = {
    "pp2-interleaved": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--pipeline-schedule",
        "interleaved-1f1b",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],
    "pp2-zbv": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--pipeline-schedule",
        "zbv",
    ],
}


def _cases() -> dict:
    out = {}
    for sizes, cases in (((1, 1, 1), DP2_CASES), ((1, 1, 2), CP2_CASES), ((1, 2, 1), PP2_CASES)):
        tp, pp, cp = sizes
        ps = mesh(tp, pp, cp=cp)
        try:
            for name, flags in cases.items():
                counts, where = _reads_per_iteration(flags, ps)
                # iteration 1 of a pipeline also checks the neighbours' shapes once
                skip = LOGGED | ({1} if pp > 1 else set())
                out[name] = ({it: n for it, n in counts.items() if it not in skip and n}, where)
        finally:
            ps.destroy()
    return out


def test_no_host_read_outside_the_log_interval_zero23_offload_cp_pp_schedules():
    for rank_result in run_distributed(_cases, 2):
        bad = {name: (counts, where) for name, (counts, where) in rank_result.items() if counts}
        assert not bad, bad
