"""Saved-tensor hooks leave a deferred-weight-grad step bit-identical.

The zero-bubble schedules (zb-h1, zbv, dualpipev) split backward into I (input grads now) and W
(weight grads later, from a ``WeightGradStore``). Autograd hands a tensor saved for backward back
through the active ``saved_tensors_hooks``; with any hooks on it rebuilds a stand-in tensor around
what the unpack hook returns, even for a parameter (without hooks it returns the parameter
itself). A W that accumulated into the unpacked weight lost that grad once I's graph was gone
(the stand-in's own ``.grad``, not the parameter's): the planner's start-up meter changed the
step's numbers. Here one 2-rank world runs each of those schedules on tiny GPT chunks (both
families, plain and through the data-parallel wrapper's ``main_grad``) with no hooks, an identity
pack/unpack, torch's ``save_on_cpu`` (a copy) and the planner's ``SavedTensorMeter``; every
micro-batch loss and every grad must be ``torch.equal`` to the run without hooks.
"""

from __future__ import annotations

import contextlib

import torch

from megalite.core.distributed import DistributedDataParallel
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.measure.saved_tensors import SavedTensorMeter
from megalite.training.model_chunks import build_gpt_chunks
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, weighted_lm_step

M = 4
SCHEDULES = (("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
HOOKS = {
    "none": contextlib.nullcontext,
    "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
    "meter": SavedTensorMeter,
}


def _step(ps, family, schedule, v, hooks, ddp):
    config = make_config(family, num_layers=4)
    modules = build_gpt_chunks(config, ps, schedule=schedule, num_chunks=v)
    if ddp:
        modules = [
            DistributedDataParallel(m, dp_group=None, accumulate_allreduce_grads_in_fp32=True)
            for m in modules
        ]
        for m in modules:
            m.zero_grad_buffer()
    chunks = [
        ModelChunk(m.module, grad_wrapper=m, index=c) if ddp else ModelChunk(m, index=c)
        for c, m in enumerate(modules)
    ]
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=(config.seq_length, 2, config.hidden_size),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
    )
    batches = [make_batch(config, seed=50 + i) for i in range(M)]
    it = iter(batches)
    with HOOKS[hooks]():
        losses = forward_backward_pipelining(
            schedule=schedule,
            forward_step_func=weighted_lm_step,
            data_iterator=[it] * v,
            model=chunks,
            num_microbatches=M,
            p2p=p2p,
            pp_rank=ps.pp_rank,
            pp_size=ps.pp_size,
        )
    grads = {}
    for c, module in enumerate(modules):
        for name, p in module.named_parameters():
            g = p.main_grad if ddp else p.grad
            grads[f"{c}.{name}"] = None if g is None else g.clone()
    return [d["lm loss"] for d in losses], grads


def _world():
    ps = mesh(1, 2)
    failures, count = [], 0
    for schedule, v in SCHEDULES:
        for family, ddp in (("gpt2", False), ("llama", True)):
            want_losses, want = _step(ps, family, schedule, v, "none", ddp)
            assert any(g is not None and g.abs().sum() > 0 for g in want.values())
            for hooks in HOOKS:
                if hooks == "none":
                    continue
                count += 1
                losses, got = _step(ps, family, schedule, v, hooks, ddp)
                label = f"rank {ps.pp_rank} {schedule} {family} ddp={ddp} hooks={hooks}"
                if not all(torch.equal(a, b) for a, b in zip(losses, want_losses)):
                    failures.append(f"{label}: losses differ")
                for name, g in want.items():
                    h = got[name]
                    if g is None or h is None:
                        if (g is None) != (h is None):
                            failures.append(f"{label}: {name} grad {h} vs {g is not None}")
                    elif not torch.equal(g, h):
                        diff = float((g - h).abs().max())
                        failures.append(f"{label}: {name} differs by {diff:.3g}")
    return count, failures


def test_saved_tensor_hooks_leave_deferred_weight_grads_bitwise():
    results = run_distributed(_world, 2, timeout=600)
    assert results[0][0] == len(SCHEDULES) * 2 * (len(HOOKS) - 1)
    failures = [f for _, fs in results for f in fs]
    assert not failures, "\n".join(failures[:20])
