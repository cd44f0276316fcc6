"""Deferred weight grads (the I / W split of the zero-bubble schedules) = the fused backward,
bitwise.

The same GPT model twice from one seed: one runs plain backward per micro-batch; the other runs
each micro-batch's backward inside ``WeightGradStore.defer`` (I), then the queued weight grads
(W), in the order a zero-bubble rank would (I0 I1 W0 I2 W1 W2). After I the linear layers' weight
and bias grads are absent (deferred) while the input grad is already there; after W every grad is
``torch.equal`` to the fused run's: W computes the same GEMM on the same tensors and hands it to
autograd's accumulation, so the sums happen in the same order. Also through the data-parallel
wrapper (its grad hooks see the deferred grads: ``main_grad`` bitwise), and under TP 2 with
sequence parallelism (2 ranks; the column-parallel W keeps the input re-gathered at I), and under
saved-tensor hooks (an identity pack/unpack and torch's ``save_on_cpu``).
"""

from __future__ import annotations

import contextlib

import torch

from megalite.core.distributed import DistributedDataParallel
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    WeightGradStore,
    attach_weight_grad_store,
)
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config


def _loss(model, batch):
    tokens, labels, weights = batch
    return (model(tokens, None, labels) * weights).sum() / weights.sum()


def _pair(family, ps, **overrides):
    config = make_config(family, num_layers=2, **overrides)
    return config, GPTModel(config, ps), GPTModel(config, ps)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _run_split(model, batches, *, grads_of=_grads):
    store = WeightGradStore()
    attach_weight_grad_store(model, store)
    checks = []
    order = [("I", 0), ("I", 1), ("W", 0), ("I", 2), ("W", 1), ("W", 2)]
    for op, i in order:
        if op == "I":
            with store.defer(i):
                _loss(model, batches[i]).backward()
            if i == 0:  # the linear weights wait; the norms and embeddings do not
                lin = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
                checks.append(all(m.weight is None or m.weight.grad is None for m in lin))
        else:
            store.flush(i)
    assert store.pending() == 0
    return checks


def _compare(fused: dict, split: dict) -> list[str]:
    return [n for n in fused if not torch.equal(fused[n], split[n])]


def test_deferred_weight_grads_are_bitwise_the_fused_backward():
    for family in ("gpt2", "llama"):
        config, a, b = _pair(family, ParallelState.single())
        batches = [make_batch(config, seed=10 + i) for i in range(3)]
        for batch in batches:
            _loss(a, batch).backward()
        checks = _run_split(b, batches)
        assert checks == [True], f"{family}: weight grads were not deferred"
        assert not _compare(_grads(a), _grads(b)), family


def test_deferred_weight_grads_are_bitwise_under_saved_tensor_hooks():
    """Under saved-tensor hooks autograd unpacks a saved parameter as a stand-in tensor: W must
    still accumulate into the parameter (the last linear's weight grad was lost)."""
    hooks = {
        "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
    }
    for family in ("gpt2", "llama"):
        for name, make in hooks.items():
            config, a, b = _pair(family, ParallelState.single())
            batches = [make_batch(config, seed=10 + i) for i in range(3)]
            for batch in batches:
                _loss(a, batch).backward()
            with make():
                _run_split(b, batches)
            split = _grads(b)
            missing = [n for n, g in split.items() if g is None]
            assert not missing, (family, name, missing)
            assert not _compare(_grads(a), split), (family, name)


def test_deferred_weight_grads_through_the_data_parallel_hooks():
    config, a, b = _pair("llama", ParallelState.single())
    wa = DistributedDataParallel(a, dp_group=None, accumulate_allreduce_grads_in_fp32=True)
    wb = DistributedDataParallel(b, dp_group=None, accumulate_allreduce_grads_in_fp32=True)
    batches = [make_batch(config, seed=20 + i) for i in range(3)]
    wa.zero_grad_buffer()
    wb.zero_grad_buffer()
    for batch in batches:
        _loss(a, batch).backward()
    _run_split(b, batches)
    main = {n: p.main_grad for n, p in a.named_parameters()}
    assert not _compare(main, {n: p.main_grad for n, p in b.named_parameters()})
    assert any(float(g.abs().sum()) > 0 for g in main.values())


def _tp_sp_case():
    ps = mesh(2, 1)
    out = []
    identity = lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)  # noqa: E731
    for family, hooks in (
        ("gpt2", contextlib.nullcontext),
        ("llama", contextlib.nullcontext),
        ("llama", identity),
    ):
        config, a, b = _pair(family, ps, sequence_parallel=True)
        batches = [make_batch(config, seed=30 + i) for i in range(3)]
        for batch in batches:
            _loss(a, batch).backward()
        with hooks():
            _run_split(b, batches)
        split = _grads(b)
        out += [n for n, g in split.items() if g is None] or _compare(_grads(a), split)
    return out


def test_deferred_weight_grads_under_tp2_sequence_parallel():
    assert run_distributed(_tp_sp_case, 2) == [[], []]
