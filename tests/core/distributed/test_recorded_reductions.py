"""ZeRO-1 and ZeRO-2 record their grad-bucket reductions when the op recorder is on (a
reduce-scatter, one record per bucket and step, per micro-batch under ZeRO-2; DDP's all-reduce is
checked by ``tests/core/test_hang_watchdog.py``), and recording changes no number: two steps on
two ranks give the same parameters on and off. The updated parameters' all-gather after each
step is recorded too, once per bucket."""

from __future__ import annotations

import torch

from megalite.core.op_record import RECORDER
from tests.core import zero_cases as zc
from tests.core.distributed.test_zero2_zero3 import run, setup
from tests.harness import run_distributed

RUNGS = {"optim": "reduce_scatter", "optim_grads": "reduce_scatter"}


def _case():
    out = {}
    for rung in RUNGS:
        torch.manual_seed(0)
        model, opt = setup(rung)
        run(model, opt, [0, 1], micro=2)
        plain = [p.detach().clone() for p in zc.params_of(model)]
        torch.manual_seed(0)
        RECORDER.enable()
        model, opt = setup(rung)
        run(model, opt, [0, 1], micro=2)
        records = RECORDER.records()
        recorded = [(r.op, r.what, r.shape) for r in records if (r.what or "").startswith("grad ")]
        gathers = [r.what for r in records if r.op == "all_gather"]
        RECORDER.disable()
        buckets = {
            f"grad bucket {i}.{b.index}"
            for i, buf in enumerate(model.grad_buffers)
            for b in buf.buckets
        }
        same = all(torch.equal(a, b) for a, b in zip(plain, zc.params_of(model)))
        out[rung] = (same, recorded, buckets, gathers)
    return out


def test_bucket_reductions_are_recorded_and_change_nothing():
    for per_rung in run_distributed(_case, 2):
        for rung, (same, recorded, buckets, gathers) in per_rung.items():
            assert same, rung
            assert recorded, rung
            assert {op for op, _, _ in recorded} == {RUNGS[rung]}, (rung, recorded)
            names = {name for _, name, _ in recorded}
            assert names == buckets, (rung, recorded, buckets)
            # ZeRO-1 reduces each bucket once a step, ZeRO-2 once per micro-batch (2 of them)
            per_step = len(buckets) * (2 if rung == "optim_grads" else 1)
            assert len(recorded) == 2 * per_step, (rung, recorded)
            # and the updated parameters' all-gather, once per bucket and step
            params = {name.replace("grad bucket", "params of bucket") for name in buckets}
            assert set(gathers) == params and len(gathers) == 2 * len(buckets), gathers
