"""Pipeline schedules on a residual toy stack: the same losses and grads as one process running
every micro-batch, activations held as the schedule promises (measured), and failures that do not
hang (stages set up for different activation shapes are told so on both before any compute).

Oracle: all layers in one module in the same rank process, built from the same keyed init, run over
the same micro-batches with no pipelining. fp32, rtol 1e-5 / atol 1e-6: the pipeline changes only
the order in which micro-batch grads are summed.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.core.pipeline_parallel.forward_backward import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_1f1b,
    forward_backward_pipelining_gpipe,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.tensor_parallel.init import init_normal
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
S, B, H, LAYERS_PER_STAGE = 4, 2, 8, 2
SCHEDULES = {"1f1b": forward_backward_pipelining_1f1b, "gpipe": forward_backward_pipelining_gpipe}


class ToyStage(nn.Module):
    """Residual layers ``h + tanh(W h + b)`` numbered globally [start, end)."""

    def __init__(self, start, end, *, is_first):
        super().__init__()
        self.is_first, self.input_tensor = is_first, None
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(start, end))
        for i, lin in zip(range(start, end), self.layers):
            init_normal(0.5, seed=1, key=f"layer{i}.w")(lin.weight.data)
            init_normal(0.1, seed=1, key=f"layer{i}.b")(lin.bias.data)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.is_first else self.input_tensor
        for lin in self.layers:
            h = h + torch.tanh(lin(h))
        return h


def _communicator(ps, shape=(S, B, H)) -> P2PCommunicator:
    return P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=shape,
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
    )


def _microbatches(m):
    g = torch.Generator().manual_seed(42)
    return [
        {"x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, H, generator=g)}
        for _ in range(m)
    ]


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["x"])

    def loss_func(output):
        loss = ((output - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


class _LiveSaved:
    """Count the bytes autograd holds in saved tensors, and their peak, while active."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        holder = _Holder(t, self)
        self.live += holder.nbytes
        self.peak = max(self.peak, self.live)
        return holder

    @staticmethod
    def unpack(holder):
        return holder.t


class _Holder:
    def __init__(self, t, counter):
        self.t, self.counter, self.nbytes = t, counter, t.numel() * t.element_size()

    def __del__(self):
        self.counter.live -= self.nbytes


def _pipeline_case(pp, m, schedule):
    ps = mesh(1, pp)
    r = ps.pp_rank
    start, end = r * LAYERS_PER_STAGE, (r + 1) * LAYERS_PER_STAGE
    stage = ToyStage(start, end, is_first=ps.is_first_stage)
    p2p = _communicator(ps)
    counter = _LiveSaved()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        losses = SCHEDULES[schedule](
            forward_step_func=_forward_step,
            data_iterator=[iter(_microbatches(m))],
            model=[ModelChunk(stage)],
            num_microbatches=m,
            p2p=p2p,
            pp_rank=r,
            pp_size=pp,
        )
    assert counter.live == 0, "saved activations outlived the step"

    # what one micro-batch's forward saves on this stage, measured the same way
    one = _LiveSaved()
    probe = ToyStage(start, end, is_first=True)
    with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
        # like the stage: only a received activation requires grad (the first stage's data doesn't)
        out = probe(torch.randn(S, B, H, requires_grad=not ps.is_first_stage))
        if ps.is_last_stage:  # and the loss, which the last stage runs too
            out = ((out - torch.randn(S, B, H)) ** 2).mean()
    per_microbatch = one.peak
    del out

    oracle = ToyStage(0, pp * LAYERS_PER_STAGE, is_first=True)
    oracle_losses = forward_backward_no_pipelining(
        forward_step_func=_forward_step,
        data_iterator=[iter(_microbatches(m))],
        model=[ModelChunk(oracle)],
        num_microbatches=m,
    )
    if ps.is_last_stage:
        assert len(losses) == m
        for got, want in zip(losses, oracle_losses):
            torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    else:
        assert losses == []
    for i, lin in enumerate(stage.layers):
        ref = oracle.layers[start + i]
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **TOL)
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **TOL)
    return counter.peak / per_microbatch


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_equals_no_pipelining_and_holds_the_promised_activations(pp):
    for m in (pp, 2 * pp + 1, 1):
        for schedule in SCHEDULES:
            in_flight = run_distributed(_pipeline_case, pp, pp, m, schedule)
            for r, held in enumerate(in_flight):
                bound = min(pp - r, m) if schedule == "1f1b" else m
                # measured peak of saved activations, in micro-batches (exact multiples here)
                assert held == pytest.approx(bound), (schedule, m, r, held)


def _forward_only_case(pp):
    ps = mesh(1, pp)
    r = ps.pp_rank
    stage = ToyStage(r * LAYERS_PER_STAGE, (r + 1) * LAYERS_PER_STAGE, is_first=ps.is_first_stage)
    p2p = _communicator(ps)
    losses = forward_backward_pipelining_1f1b(
        forward_step_func=_forward_step,
        data_iterator=[iter(_microbatches(5))],
        model=[ModelChunk(stage)],
        num_microbatches=5,
        p2p=p2p,
        pp_rank=r,
        pp_size=pp,
        forward_only=True,
    )
    assert all(p.grad is None for p in stage.parameters())
    oracle = ToyStage(0, pp * LAYERS_PER_STAGE, is_first=True)
    with torch.no_grad():
        want = [
            _forward_step(it, oracle)[1](oracle(b["x"]))[0]
            for it, b in ((iter([b]), b) for b in _microbatches(5))
        ]
    if ps.is_last_stage:
        for got, w in zip(losses, want):
            torch.testing.assert_close(got["loss"], w, **TOL)
    return len(losses)


def test_forward_only_for_evaluation():
    assert run_distributed(_forward_only_case, 2, 2) == [0, 5]


def _mismatch_case():
    ps = mesh(1, 2)
    r = ps.pp_rank
    shape = (S, B, H) if ps.is_first_stage else (S, B, H + 1)  # stage 1 was set up differently
    stage = ToyStage(r * LAYERS_PER_STAGE, (r + 1) * LAYERS_PER_STAGE, is_first=ps.is_first_stage)
    try:
        forward_backward_pipelining_1f1b(
            forward_step_func=_forward_step,
            data_iterator=[iter(_microbatches(2))],
            model=[ModelChunk(stage)],
            num_microbatches=2,
            p2p=_communicator(ps, shape),
            pp_rank=r,
            pp_size=2,
        )
    except RuntimeError as e:
        return str(e), [p.grad for p in stage.parameters()]
    return None, None


def test_shape_mismatch_between_stages_is_reported_on_both_not_a_hang():
    results = run_distributed(_mismatch_case, 2, timeout=600)
    for e, grads in results:
        assert e is not None and "pipeline stages disagree" in e
        assert grads == [None] * len(grads), "a stage ran before the shapes were checked"
        assert "[4, 2, 8] torch.float32 vs [4, 2, 9] torch.float32" in e
        assert "\n" not in e


def _failing_stage_case(pp, fail_rank, linger, folder):
    """Micro-batch 3 of ``fail_rank`` raises; every rank returns (its exception's name, the first
    line, and on the failed rank whether every peer had ended while it lingered). ``linger``: the
    failed rank stays in the case, its connections open, until each peer has ended its step with
    an error (a file per rank in ``folder``), so the peers cannot have learnt of the failure from
    it leaving: only from their collective timeout."""
    ps = mesh(1, pp, timeout=timedelta(seconds=5))
    r = ps.pp_rank
    stage = ToyStage(r * LAYERS_PER_STAGE, (r + 1) * LAYERS_PER_STAGE, is_first=ps.is_first_stage)
    p2p = _communicator(ps)
    calls = {"n": 0}

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if dist.get_rank() == fail_rank and calls["n"] == 3:
            raise ValueError("injected failure in micro-batch 3")
        return _forward_step(data_iterator, model)

    try:
        forward_backward_pipelining_1f1b(
            forward_step_func=forward_step,
            data_iterator=[iter(_microbatches(6))],
            model=[ModelChunk(stage)],
            num_microbatches=6,
            p2p=p2p,
            pp_rank=r,
            pp_size=pp,
        )
    except Exception as e:  # noqa: BLE001 - every rank must end with an error, which we return
        me, peers_ended = dist.get_rank(), None
        if me != fail_rank:
            (Path(folder) / f"ended{me}").touch()
        elif linger:
            peers = [Path(folder) / f"ended{k}" for k in range(pp) if k != fail_rank]
            deadline = time.monotonic() + 60  # a hang guard: the peers' timeout is 5 s
            while not all(p.exists() for p in peers) and time.monotonic() < deadline:
                time.sleep(0.05)
            peers_ended = all(p.exists() for p in peers)
        return type(e).__name__, str(e).splitlines()[0][:200], peers_ended
    return None


@pytest.mark.parametrize("linger", [False, True], ids=["failed-rank-exits", "failed-rank-lingers"])
def test_an_exception_in_one_stage_ends_every_rank_within_the_timeout(linger, tmp_path):
    # collective timeout 5 s; a lingering failed rank keeps its connections open until every
    # other rank has ended with an error
    results = run_distributed(_failing_stage_case, 4, 4, 1, linger, str(tmp_path), timeout=600)
    assert results[1][0] == "ValueError"
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} finished its step although stage 1 failed"
    if linger:
        assert results[1][2], "a peer ended only once the failed rank left, not by its timeout"
