"""Megatron's ``--grad-reduce-in-bf16`` (with ``--bf16`` the grads are accumulated and reduced over
DP in bf16, not in fp32 as by default). The grad buffer is bf16; after the step's sync each DP rank
holds, bitwise, the hand-reduced bf16 value: per rank the micro-batch grads summed in bf16, divided
by DP in bf16, then the ranks' values summed and rounded to bf16 once (two ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed import DistributedDataParallel
from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError
from tests.harness import run_distributed

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 2 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127 --bf16"
).split()


def test_flag_sets_bf16_grad_buffers_and_conflicts_are_one_line():
    cfg = parse_args([*BASE, "--grad-reduce-in-bf16"])
    assert cfg.parallel.accumulate_allreduce_grads_in_fp32 is False
    assert parse_args(BASE).parallel.accumulate_allreduce_grads_in_fp32 is True  # the default
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"])
    assert "\n" not in str(e.value) and "contradict" in str(e.value)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)).to(
        torch.bfloat16
    )


def _inputs() -> torch.Tensor:  # [dp=2, micro-batches=2, b=3, 16]
    return torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _loss(model, x):
    return (model(x).float() ** 2).mean()


def _local_grads(x_rank: torch.Tensor) -> list[torch.Tensor]:
    """One rank's grads without any collective: micro-batch grads summed in bf16."""
    model = _model()
    acc = None
    for x in x_rank:
        model.zero_grad()
        _loss(model, x).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]  # bf16 adds
    return acc


def _reduce_case() -> list[torch.Tensor]:
    rank = dist.get_rank()
    x = _inputs().chunk(2, dim=0)[rank][0]  # this rank's two micro-batches
    model = DistributedDataParallel(
        _model(), dp_group=dist.group.WORLD, accumulate_allreduce_grads_in_fp32=False
    )
    model.zero_grad_buffer()
    with model.no_sync():
        _loss(model, x[0]).backward()
    _loss(model, x[1]).backward()
    model.finish_grad_sync()
    return [p.main_grad.clone() for p in model.module.parameters()]


def test_grads_reduced_in_bf16_equal_the_hand_reduction():
    x = _inputs()
    per_rank = [_local_grads(x[r]) for r in range(2)]
    hand = [(a / 2) + (b / 2) for a, b in zip(*per_rank)]  # bf16: one rounding of the sum
    exact = [a.float() / 2 + b.float() / 2 for a, b in zip(*per_rank)]  # an fp32 reduction
    results = run_distributed(_reduce_case, 2)
    for got in results:
        for g, h in zip(got, hand):
            assert g.dtype == torch.bfloat16
            assert torch.equal(g, h)
    # the bf16 reduction is not the fp32 one (the test would see a buffer in the wrong dtype)
    assert any(not torch.equal(h.float(), e) for h, e in zip(hand, exact))
