"""The planner's grad bytes follow the grad buffers' dtype: bf16 params get fp32 grads unless
``--grad-reduce-in-bf16`` (Megatron's rule, ``ParallelConfig.accumulate_allreduce_grads_in_fp32``),
fp16 and fp32 params keep their dtype; one bucket, no padding: grads = bytes x parameters."""

from __future__ import annotations

import pytest

from megalite.models.config import GPTConfig
from megalite.planning.model_state import model_state_bytes

CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)


def _grads(precision: str, **kwargs) -> tuple[int, int]:
    b = model_state_bytes(
        CFG, tp=1, pp=1, dp=1, pp_rank=0, precision=precision, bucket_size=None, **kwargs
    )
    return b.grads, b.num_params


@pytest.mark.parametrize(
    "precision,kwargs,grad_bytes",
    [
        ("bf16", {}, 4),  # the default: Megatron's fp32 grads under bf16
        ("bf16", {"grads_in_fp32": False}, 2),  # --grad-reduce-in-bf16
        ("fp16", {}, 2),
        ("fp16", {"grads_in_fp32": True}, 4),  # --accumulate-allreduce-grads-in-fp32
        ("fp32", {}, 4),
    ],
)
def test_grad_bytes_follow_the_grad_dtype(precision, kwargs, grad_bytes):
    grads, params = _grads(precision, **kwargs)
    assert params > 0 and grads == grad_bytes * params
