"""Activation recomputation gives the same loss and grads as none, with dropout ON.

With dropout on, the recomputation in backward must draw exactly the forward's masks (default
generator and the tracker's tensor-parallel state, replayed by
``tensor_parallel.random.checkpoint``); otherwise the grads belong to a different network.
Tolerance: the loss must be bitwise equal (the forward runs the same ops on the same RNG stream);
grads to 1e-6 relative (the same ops, but a parameter's grad may be accumulated in a different order
when backward runs chunk by chunk). The tests also check that recomputation happens (layers run
twice) and frees activations (fewer bytes saved for backward), so a setting that silently did
nothing would fail.
"""

from __future__ import annotations

import pytest
import torch

import megalite.models.transformer as transformer_module
from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.random import checkpoint, model_parallel_seed
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err

SETTINGS = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform"),
    "full-uniform-2": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
    ),
    "full-block-2": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    ),
    "selective": dict(recompute_granularity="selective"),
}
DROPOUT = dict(hidden_dropout=0.3, attention_dropout=0.3, num_layers=3)


class _Counter:
    """Counts forward calls of the layers and core attentions, and bytes saved for backward."""

    def __init__(self, model: GPTModel):
        self.layer_calls = self.attention_calls = self.saved_bytes = 0
        self.param_ptrs = {p.data_ptr() for p in model.parameters()}
        for layer in model.decoder.layers:
            layer.register_forward_hook(self._count_layer)
            layer.self_attention.core_attention.register_forward_hook(self._count_attention)

    def _count_layer(self, *_):
        self.layer_calls += 1

    def _count_attention(self, *_):
        self.attention_calls += 1

    def pack(self, t):
        if t.data_ptr() not in self.param_ptrs:  # activations only
            self.saved_bytes += t.numel() * t.element_size()
        return t


def _train_step(model, config, states, ps) -> tuple[torch.Tensor, dict, _Counter]:
    """Forward + backward from the RNG states ``states`` (so every variant draws the same masks)."""
    cpu_state, tracker, tracker_states = states
    torch.set_rng_state(cpu_state)
    tracker.set_states(tracker_states)
    counter = _Counter(model)
    tokens, labels, weights = make_batch(config)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = model(tokens, None, labels)
    (loss * weights).sum().backward()
    all_reduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counter


def _compare_recompute(ps, family: str, backend: str, sp: bool = False) -> dict[str, dict]:
    """Per setting: loss bitwise equal?, max grad error, call counts, saved bytes vs none."""
    tracker = model_parallel_seed(1234, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)
    states = (torch.get_rng_state(), tracker, tracker.get_states())
    out = {}
    results = {}
    for name, setting in {"none": {}, **SETTINGS}.items():
        config = make_config(
            family, attention_backend=backend, sequence_parallel=sp, **DROPOUT, **setting
        )
        model = GPTModel(config, ps, rng_tracker=tracker)
        results[name] = _train_step(model, config, states, ps)
    ref_loss, ref_grads, ref_count = results["none"]
    no_dropout = make_config(family, attention_backend=backend, sequence_parallel=sp, num_layers=3)
    plain_loss, _, _ = _train_step(GPTModel(no_dropout, ps), no_dropout, states, ps)
    for name, (loss, grads, count) in results.items():
        out[name] = dict(
            loss_equal=bool(torch.equal(loss, ref_loss)),
            dropout_changed_loss=rel_err(loss, plain_loss) > 1e-3,
            grad_err=max(rel_err(grads[n], ref_grads[n]) for n in ref_grads),
            layer_calls=count.layer_calls,
            attention_calls=count.attention_calls,
            saved_ratio=count.saved_bytes / ref_count.saved_bytes,
        )
    return out


# expected forward calls for 3 layers: full recompute re-runs the recomputed layers in backward
EXPECTED_CALLS = {
    "none": (3, 3),
    "full-uniform-1": (6, 6),
    "full-uniform-2": (6, 6),
    "full-block-2": (5, 5),
    "selective": (3, 6),
}


def _check(out: dict[str, dict], where: str) -> None:
    for name, r in out.items():
        assert r["loss_equal"], f"{where} {name}: loss differs from no recompute"
        assert r["dropout_changed_loss"], f"{where} {name}: dropout had no effect"
        assert r["grad_err"] <= 1e-6, f"{where} {name}: grad error {r['grad_err']:.2e}"
        assert (r["layer_calls"], r["attention_calls"]) == EXPECTED_CALLS[name], (where, name, r)
        if name != "none":
            assert r["saved_ratio"] < 0.9, f"{where} {name}: saved {r['saved_ratio']:.2f} of none"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_recompute_matches_none_with_dropout(family, backend):
    with torch.random.fork_rng():
        _check(_compare_recompute(ParallelState.single(), family, backend), f"{family}/{backend}")


def _tp2_sp_case():
    ps = mesh(2)
    return {
        f"{family}/{backend}": _compare_recompute(ps, family, backend, sp=True)
        for family in ("gpt2", "llama")
        for backend in ("sdpa", "unfused")
    }


def test_recompute_matches_none_tp2_sequence_parallel_with_dropout():
    for rank, per_case in enumerate(run_distributed(_tp2_sp_case, 2)):
        for where, out in per_case.items():
            _check(out, f"rank {rank} {where}")


def test_recompute_without_tracker_replay_would_differ(monkeypatch):
    """The comparison can fail: if the tracker's state were not replayed, the recomputed attention
    dropout masks would differ from the forward's and so would the grads."""

    def no_tracker_replay(function, *args, tracker, device):
        return checkpoint(function, *args, tracker=None, device=device)

    monkeypatch.setattr(transformer_module, "checkpoint", no_tracker_replay)
    with torch.random.fork_rng():
        out = _compare_recompute(ParallelState.single(), "gpt2", "sdpa")
    assert out["full-uniform-1"]["grad_err"] > 1e-3
