"""Activations each schedule holds, measured: the peak bytes autograd keeps in saved tensors on
every rank (saved-tensor hooks), in units of one micro-batch through one chunk, equals the
schedule's formula and the simulator's replay of the same action list.

PP 4, m 8, toy chunks of one residual layer ``h + tanh(W h + b)`` each (megalite's row-parallel
linear, so I / W really split), every chunk's input requiring grad so all chunks save the same
bytes; the loss is a mean (saves nothing). Formulas (rank r): 1F1B and ZB-H1 ``min(p - r, m)``;
GPipe ``m``; interleaved ``min(2 (p - r - 1) + (v - 1) p + 1, m v)``; ZB-H1 with v 2 and ZBV at
most ``v p`` (1F1B's memory); DualPipeV ``2p + 1``. After I only what W needs stays (not saved
tensors any more: the W closure keeps each linear's input and output grad).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.simulator import Costs, simulate
from megalite.core.tensor_parallel.layers import RowParallelLinear
from tests.harness import run_distributed
from tests.mesh import mesh

S, B, H, P, M = 4, 2, 8, 4, 8
CASES = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h1", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def formula(schedule, p, r, m, v):
    if schedule in ("1f1b",) or (schedule == "zb-h1" and v == 1):
        return min(p - r, m)
    if schedule == "gpipe":
        return m
    if schedule == "interleaved-1f1b":
        return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    if schedule == "dualpipev":
        return 2 * p + 1
    return v * p  # zb-h1 with v > 1, zbv: an upper bound


class Chunk(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first, self.input_tensor = first, None
        self.lin = RowParallelLinear(H, H, tp_group=None)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        return h + torch.tanh(self.lin(h)[0])


def _forward_step(data_iterator, model):
    x = next(data_iterator).clone().requires_grad_()
    out = model(x)
    return out, lambda o: (o.mean(), {"loss": o.mean().detach()})


class _LiveSaved:
    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        return _Holder(t, self)

    @staticmethod
    def unpack(h):
        return h.t


class _Holder:
    def __init__(self, t, c):
        self.t, self.c, self.n = t, c, t.numel() * t.element_size()

    def __del__(self):
        self.c.live -= self.n


def _case():
    ps = mesh(1, P)
    r = ps.pp_rank
    probe, one = Chunk(first=True), _LiveSaved()
    with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
        _forward_step(iter([torch.randn(S, B, H)]), probe)
    per_chunk = one.peak
    out = []
    for schedule, v in CASES:
        layout = layout_of(schedule, P, v)
        chunks = [
            ModelChunk(Chunk(first=layout.stage(r, c) == 0), index=c)
            for c in range(layout.num_chunks)
        ]
        p2p = P2PCommunicator(
            prev_rank=ps.prev_rank,
            next_rank=ps.next_rank,
            tensor_shape=(S, B, H),
            dtype=torch.float32,
            device=torch.device("cpu"),
            group=ps.pp_group,
            pp_ranks=ps.pp_ranks,
        )
        data = [torch.randn(S, B, H) for _ in range(M)]
        counter = _LiveSaved()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            forward_backward_pipelining(
                schedule=schedule,
                forward_step_func=_forward_step,
                model=chunks,
                data_iterator=[iter(data)] * len(chunks),
                num_microbatches=M,
                p2p=p2p,
                pp_rank=r,
                pp_size=P,
            )
        assert counter.live == 0, "saved activations outlived the step"
        compute = generate(schedule, pp_size=P, num_microbatches=M, num_chunks=v)
        sim = simulate(with_p2p(compute, layout), layout, Costs())
        out.append((schedule, v, counter.peak / per_chunk, sim.peak_in_flight[r]))
    return out


def test_saved_activations_per_rank_equal_each_schedules_formula():
    results = run_distributed(_case, P)
    for r, rows in enumerate(results):
        for schedule, v, measured, simulated in rows:
            assert measured == simulated, (schedule, v, r, measured, simulated)
            bound = formula(schedule, P, r, M, v)
            if schedule in ("zbv",) or (schedule == "zb-h1" and v > 1):
                assert measured <= bound, (schedule, v, r, measured, bound)
            else:
                assert measured == bound, (schedule, v, r, measured, bound)
