"""GPTModel sharded over TP (with or without sequence parallel) computes the single-process
function.

Each rank builds the TP model and, in the same process, the oracle: the same GPTModel built with
``ParallelState.single()`` from the same seed. Both run one forward (per-token loss) and one
backward of a randomly weighted sum of the losses. The TP model's per-token loss must equal the
oracle's, and each of its parameters' grads must equal the oracle's grad sliced to this rank
(``helpers.shard_of_full``: whole query groups of the QKV weight, both halves of SwiGLU's fc1,
vocabulary rows of the padded embedding), sequence-parallel grads after
``all_reduce_sequence_parallel_grads``.

Tolerance: 1e-5 norm-wise relative, per tensor. Everything is fp32 on CPU and the two computations
differ only in the order of reductions (sharded GEMMs' partial sums, all-reduce / reduce-scatter
order), which gives errors of a few fp32 ulps times sqrt(terms): ~1e-7..1e-6 here; a wrong shard,
missing reduction or misplaced head is O(1).
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err, shard_of_full

TOL = 1e-5
CASES = [
    (family, sp, backend)
    for family in ("gpt2", "llama")
    for sp in (False, True)
    for backend in ("sdpa", "unfused")
]


def _run(model: GPTModel, config) -> torch.Tensor:
    tokens, labels, weights = make_batch(config)
    loss = model(tokens, None, labels)  # [b, s]
    (loss * weights).sum().backward()
    return loss.detach()


def _compare_case(tp_size: int, cases) -> list[tuple[str, dict[str, float]]]:
    """On every rank: errors of the TP model against the oracle, per case and tensor."""
    ps = mesh(tp_size)
    out = []
    for family, sp, backend in cases:
        # make_vocab_size_divisible_by=8: padded vocab 104 (oracle), 112 (TP2), 128 (TP4)
        config = make_config(
            family,
            sequence_parallel=sp,
            attention_backend=backend,
            make_vocab_size_divisible_by=8,
            use_fused_kernels=False,
        )
        model = GPTModel(config, ps)
        oracle = GPTModel(config, ParallelState.single())
        errors = {"loss": rel_err(_run(model, config), _run(oracle, config))}
        all_reduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
        ref = dict(oracle.named_parameters())
        for name, p in model.named_parameters():
            expected = shard_of_full(
                name, ref[name].grad, config, tp_size=ps.tp_size, tp_rank=ps.tp_rank
            )
            if p.grad is None or p.grad.shape != expected.shape:
                errors[name] = float("inf")
            else:
                errors[name] = rel_err(p.grad, expected)
        if set(ref) != {n for n, _ in model.named_parameters()}:
            errors["<parameter names differ from the oracle's>"] = float("inf")
        out.append((f"tp{tp_size}-{family}-sp{int(sp)}-{backend}", errors))
    return out


def _tp1_and_tp2(cases):
    return _compare_case(1, cases) + _compare_case(2, cases)


def _check(results_per_rank) -> None:
    bad = []
    for rank, results in enumerate(results_per_rank):
        for case, errors in results:
            bad += [f"rank {rank} {case} {k}: {v:.2e}" for k, v in errors.items() if not v <= TOL]
    assert not bad, "TP model differs from the single-process oracle:\n" + "\n".join(bad)


def test_tp1_tp2_match_single_process_oracle():
    # world of 2: TP1 (the two ranks are DP replicas), then TP2
    _check(run_distributed(_tp1_and_tp2, 2, CASES))


@pytest.mark.slow
def test_tp4_matches_single_process_oracle():
    _check(run_distributed(_compare_case, 4, 4, CASES))


def test_slicing_rule_catches_a_wrong_qkv_layout():
    """The comparison can fail: slicing a per-group QKV grad head-major (the HF c_attn order)
    instead of by group gives a different shard."""
    config = make_config("llama")
    full = torch.randn(config.num_query_groups * (config.heads_per_group + 2) * 8, 64)
    by_group = shard_of_full("x.linear_qkv.weight", full, config, tp_size=2, tp_rank=1)
    q, k, v = full.view(4, 4, 8, 64).split([2, 1, 1], dim=1)
    head_major = torch.cat([t.reshape(-1, 64).chunk(2)[1] for t in (q, k, v)])
    assert by_group.shape == head_major.shape and rel_err(head_major, by_group) > 0.1
