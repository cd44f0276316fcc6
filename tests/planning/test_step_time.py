"""The planner's step time against measurement on CPU, after calibration in the same world.

One 2-rank gloo world calibrates itself (``calibrate.calibrate_in_world``: the cores its ranks
share, the compute rate and the fixed costs per layer pass, chunk pass and step with every rank
busy, each collective between busy ranks) and then predicts and runs each layout below
(``tools/planner/accuracy.py``: medians of 4 steps, the slowest rank's), every feature: DP with
each ZeRO rung, TP, TP with SP, PP with each of the six schedules, full and selective recompute,
CP, EP.

The error is taken at the machine's speed of the moment: each measured step runs right after a
step of the calibration's reference model, and the prediction is scaled by how much that reference
ran slower or faster than predicted (``accuracy.Row.error``; this shared 2-core machine's speed
drifts 30-50% within a minute, which is not what the model is asked about). A layout outside the
bar is calibrated and measured again, up to twice (a systematic miss stays a miss). Takes 60-110 s.
``MEGALITE_PLANNER_TIMING=0`` skips it (a machine too loaded to time anything).

Ranking (the issue's bar): among candidates of clearly different speed, the layout predicted
fastest runs within 10% of the measured fastest: on the reference model (5 candidates) and on a
small model (4 candidates, ~9 s).
"""

from __future__ import annotations

import os

import pytest

from megalite.planning.predict import Layout
from tests.harness import run_distributed
from tools.planner.calibrate import REFERENCE

opt_out = pytest.mark.skipif(
    os.environ.get("MEGALITE_PLANNER_TIMING") == "0",
    reason="timing accuracy: skipped by MEGALITE_PLANNER_TIMING=0",
)
MODEL = [a for a in REFERENCE if a not in ("--vocab-size", "1024")] + ["--seq-length", "64"]
VOCAB, GBS, BAR, RETRIES, STEPS = 1024, 8, 0.20, 2, 4
ACCURATE = [
    Layout(dp=2, micro_batch_size=4),
    Layout(dp=2, micro_batch_size=4, rung="optim"),
    Layout(dp=2, micro_batch_size=4, rung="optim_grads"),
    Layout(dp=2, micro_batch_size=4, rung="optim_grads_params"),
    Layout(dp=2, micro_batch_size=4, recompute="full"),
    Layout(pp=2, micro_batch_size=1),
    Layout(pp=2, micro_batch_size=1, schedule="gpipe"),
    Layout(pp=2, micro_batch_size=1, schedule="interleaved-1f1b", vp=2),
    Layout(pp=2, micro_batch_size=1, schedule="zb-h1"),
    Layout(pp=2, micro_batch_size=1, schedule="zbv", vp=2),
    Layout(pp=2, micro_batch_size=1, schedule="dualpipev", vp=2),
    Layout(cp=2, micro_batch_size=4),
    Layout(tp=2, micro_batch_size=4),
    Layout(tp=2, micro_batch_size=4, sequence_parallel=True),
    Layout(tp=2, micro_batch_size=4, recompute="selective"),
    (Layout(dp=2, ep=2, micro_batch_size=4), ["--num-experts", "4", "--moe-router-topk", "2"]),
]
RANKED = [  # clearly different speeds: the ranking, not the noise, decides
    Layout(dp=2, micro_batch_size=4),
    Layout(dp=2, micro_batch_size=1),
    Layout(dp=2, micro_batch_size=4, recompute="full"),
    Layout(tp=2, micro_batch_size=4, sequence_parallel=True),
    Layout(pp=2, micro_batch_size=1),
]


def _case():
    from tools.planner.accuracy import step_time_accuracy

    items = ACCURATE + [lay for lay in RANKED if lay not in ACCURATE]
    reference = [*MODEL, "--vocab-size", str(VOCAB)]
    calibration, rows = step_time_accuracy(
        MODEL, items, vocab_size=VOCAB, global_batch_size=GBS, reference=reference, steps=STEPS
    )
    for i in range(len(rows)):
        for _ in range(RETRIES):  # a miss: again, freshly calibrated (a systematic miss stays)
            if i >= len(ACCURATE) or abs(rows[i].error) <= BAR:
                break
            _, again = step_time_accuracy(MODEL, [items[i]], vocab_size=VOCAB, steps=STEPS,
                                          global_batch_size=GBS, reference=reference)  # fmt: skip
            rows[i] = again[0]
    for row in rows:
        print(f"{row.layout.name():<40} predicted {row.predicted:.4f} s measured "
              f"{row.measured:.4f} s: {row.error:+.1%} ({row.raw_error:+.1%} raw)")  # fmt: skip
    accurate = {lay if isinstance(lay, Layout) else lay[0] for lay in ACCURATE}
    return calibration, {r.layout: (r.predicted, r.measured, r.error, r.layout in accurate)
                         for r in rows}  # fmt: skip


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_case, 2, timeout=600)[0]


@opt_out
def test_step_time_within_20_percent_after_calibration(measured):
    calibration, rows = measured
    assert calibration["efficiency"] > 0
    misses = [
        f"{lay.name()}: predicted {p:.3f} s, measured {m:.3f} s ({err:+.0%} at the machine's speed "
        f"of the moment, {p / m - 1:+.0%} at calibration's)"
        for lay, (p, m, err, accurate) in rows.items()
        if accurate and abs(err) > BAR
    ]
    assert not misses, "; ".join(misses)


@opt_out
def test_predicted_best_layout_is_within_10_percent_of_measured_best(measured):
    _check_ranking(measured[1], RANKED)


SMALL = [*MODEL, "--hidden-size", "128", "--num-layers", "4"]
SMALL_RANKED = [  # DP2 mbs4 should win; each other candidate is >= 1.3x slower when measured
    Layout(dp=2, micro_batch_size=4),
    Layout(dp=2, micro_batch_size=1),
    Layout(tp=2, micro_batch_size=4, sequence_parallel=True),
    Layout(pp=2, micro_batch_size=1),
]


def _ranking_case():
    from tools.planner.accuracy import step_time_accuracy

    reference = [*SMALL, "--vocab-size", str(VOCAB)]
    _, rows = step_time_accuracy(SMALL, SMALL_RANKED, vocab_size=VOCAB, global_batch_size=GBS,
                                 reference=reference)  # fmt: skip
    return {r.layout: (r.predicted, r.measured, r.error) for r in rows}


def test_ranking_agrees_with_measurement():
    """The suite's ranking check (the issue's bar), on a small model: cheap, and the candidates'
    measured speeds differ by more than this machine's noise."""
    _check_ranking(run_distributed(_ranking_case, 2, timeout=200)[0], SMALL_RANKED)


def _check_ranking(rows, candidates):
    predicted = {lay: rows[lay][0] for lay in candidates}
    times = {lay: rows[lay][1] for lay in candidates}
    best = min(predicted, key=predicted.get)
    assert max(times.values()) > 1.3 * min(times.values())  # the candidates do differ
    assert times[best] <= 1.10 * min(times.values()), (best.name(), times)
