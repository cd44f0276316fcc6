"""The schedule tells the data-parallel wrappers which micro-batch is the last (``no_sync``).

2 ranks (DP 2), the ``zero_cases.Tiny`` model (3 buckets), 4 micro-batches per rank driven by
``forward_backward_no_pipelining``, for the all-reduce wrapper and ZeRO's, overlap on and off:

- overlap is bitwise the run without it (the same sums in the same order), for both wrappers;
- no reduction is in flight before the last micro-batch's backward (each forward records the
  count: the earlier backwards ran inside ``no_sync``), and some are after it (started by the
  hooks, before ``finish_grad_sync``);
- a schedule that runs the backwards outside ``no_sync`` (a chunk without its grad wrapper) makes
  the second micro-batch's grad arrive for a bucket whose reduction has started: a RuntimeError
  naming the parameter, not a silent wrong sum.

One process: ``GradBufferLayout`` is arithmetic only and agrees with the storage built from it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.distributed import (
    DistributedDataParallel,
    GradBuffer,
    GradBufferLayout,
    Zero1DataParallel,
)
from megalite.core.optimizer import build_optimizer, build_sharded_optimizer
from megalite.core.pipeline_parallel.forward_backward import forward_backward_no_pipelining
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from tests.core import zero_cases as zc
from tests.harness import run_distributed

MICRO = 4  # 8 rows per global batch: one row per micro-batch at DP 2


def _setup(zero: bool, overlap: bool):
    group = dist.group.WORLD
    common = {"dp_group": group, "accumulate_allreduce_grads_in_fp32": True}
    if zero:
        model = Zero1DataParallel(
            zc.tiny(), bucket_size=zc.BUCKET, overlap_grad_reduce=overlap, **common
        )
        opt = build_sharded_optimizer(model, lr=zc.LR, weight_decay=zc.WD, clip_grad=zc.CLIP)
    else:
        model = DistributedDataParallel(
            zc.tiny(), bucket_size=zc.BUCKET, overlap_grad_reduce=overlap, **common
        )
        opt = build_optimizer(model, lr=zc.LR, weight_decay=zc.WD, clip_grad=zc.CLIP)
    return model, opt


def _train(model, opt, chunk, steps: int = 3) -> tuple[list, list, list]:
    """``steps`` steps; returns per step the reductions in flight at each forward and after the
    schedule, the grad norms, and the final params."""
    rank, dp = zc.dp_info()
    in_flight, norms = [], []
    for step in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        batches = zc.micro_batches(step, dp * MICRO)[rank * MICRO : (rank + 1) * MICRO]
        seen = []

        def forward_step(data_iterator, module, seen=seen):
            seen.append(len(model._reducing))
            tokens, targets = next(data_iterator)
            return module(tokens), lambda out: (zc.loss_of_logits(out, targets), {})

        forward_backward_no_pipelining(
            forward_step_func=forward_step,
            data_iterator=[iter(batches)],
            model=[chunk],
            num_microbatches=MICRO,
        )
        seen.append(len(model._reducing))
        model.finish_grad_sync()
        _, norm, _ = opt.step()
        in_flight.append(seen)
        norms.append(float(norm))
    return in_flight, norms, zc.params_of(model)


def _sync_case() -> dict:
    out = {}
    for zero in (False, True):
        for overlap in (False, True):
            model, opt = _setup(zero, overlap)
            chunk = ModelChunk(model.module, grad_wrapper=model)
            out[(zero, overlap)] = _train(model, opt, chunk)
    errors = {}
    for zero in (False, True):
        model, opt = _setup(zero, True)
        try:  # a chunk without its grad wrapper: every backward looks like the last
            _train(model, opt, ModelChunk(model.module), steps=1)
        except RuntimeError as e:
            errors[zero] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_sync_case, 2, timeout=600)


def test_overlap_is_bitwise_the_same_and_starts_only_after_the_last_micro_batch(results):
    for r in results:
        for zero in (False, True):
            seen_off, norms_off, params_off = r[(zero, False)]
            seen_on, norms_on, params_on = r[(zero, True)]
            assert norms_on == norms_off, zero
            assert all(torch.equal(a, b) for a, b in zip(params_on, params_off)), zero
            for seen in seen_off:
                assert seen == [0] * (MICRO + 1), (zero, seen)
            for seen in seen_on:  # nothing before the last backward, started by it
                assert seen[:MICRO] == [0] * MICRO and seen[MICRO] > 0, (zero, seen)


def test_a_grad_after_its_bucket_reduction_started_is_an_error(results):
    for r in results:
        for zero in (False, True):
            message = r["errors"].get(zero)
            assert message is not None, f"zero={zero}: no error although no_sync was skipped"
            assert "after its reduction started" in message and "no_sync" in message
            assert "\n" not in message and (
                "fc" in message or "norm" in message or "emb" in message
            )


def test_layout_is_arithmetic_and_agrees_with_the_storage():
    numels = [10, 20, 30, 5]
    layout = GradBufferLayout(numels, bucket_size=25, pad_multiple=4)
    assert [(b.offset, b.numel, b.params) for b in layout.buckets] == [
        (0, 36, (3, 2)),
        (36, 32, (1, 0)),
    ]
    assert layout.param_ranges == [(56, 66, 1), (36, 56, 1), (5, 35, 0), (0, 5, 0)]
    assert layout.numel == 68
    # DP 4: a quarter of each bucket; the rank's flat shard concatenates them
    assert layout.shard_segments(4, 1) == [(9, 18, 0), (44, 52, 9)]
    assert layout.shard_range(1, 4, 3) == (60, 68)
    with pytest.raises(ValueError, match="bucket 0 of 36 elements does not split into 5"):
        layout.shard_range(0, 5, 0)
    with pytest.raises(ValueError, match="bucket_size"):
        GradBufferLayout(numels, bucket_size=0)

    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    storage = GradBuffer(params, grad_dtype=torch.float32, bucket_size=25, pad_multiple=4)
    assert [storage.param_ranges[p] for p in params] == layout.param_ranges
    assert [b.data.numel() for b in storage.buckets] == [b.numel for b in layout.buckets]
