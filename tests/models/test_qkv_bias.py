"""``--add-qkv-bias`` (Qwen2 / Qwen2-MoE): a bias on the QKV projection only, sharded
over TP by whole query groups like the weight's rows (checkpoint key ``linear_qkv.bias``).

A Llama-family model with the bias (drawn non-zero, the same full tensor in both) at TP2 with
sequence parallel computes the single-process oracle's per-token losses, and every grad equals
the oracle's sliced to the rank (``helpers.shard_of_full``; 1e-5 relative, fp32).
"""

from __future__ import annotations

import torch

from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err, shard_of_full


def _compare() -> dict[str, float]:
    ps = mesh(2)
    config = make_config(
        "llama",
        add_qkv_bias=True,
        sequence_parallel=True,
        make_vocab_size_divisible_by=8,
        use_fused_kernels=False,
    )
    model, oracle = GPTModel(config, ps), GPTModel(config, ParallelState.single())
    biases = {n: p for n, p in oracle.named_parameters() if n.endswith("linear_qkv.bias")}
    assert len(biases) == config.num_layers and not any(
        n.endswith(("linear_proj.bias", "linear_fc1.bias")) for n, _ in model.named_parameters()
    )
    own = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in biases.items():
            p.copy_(torch.randn(p.shape, generator=g))
            own[name].copy_(shard_of_full(name, p, config, tp_size=2, tp_rank=ps.tp_rank))
    tokens, labels, weights = make_batch(config)
    losses = []
    for m in (model, oracle):
        loss = m(tokens, None, labels)
        (loss * weights).sum().backward()
        losses.append(loss.detach())
    errors = {"loss": rel_err(*losses)}
    all_reduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
    ref = dict(oracle.named_parameters())
    for name, p in model.named_parameters():
        expected = shard_of_full(name, ref[name].grad, config, tp_size=2, tp_rank=ps.tp_rank)
        errors[name] = rel_err(p.grad, expected) if p.grad.shape == expected.shape else 1.0
    return errors


def test_qkv_bias_tp2_sequence_parallel_matches_single_process():
    for errors in run_distributed(_compare, 2):
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, bad
