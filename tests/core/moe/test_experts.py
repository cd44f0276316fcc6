"""The experts of one rank: compute and saved activations follow the tokens routed to them.

Both paths (the per-expert loop, and ``grouped_gemm``) equal a float64 oracle written from the full
weights, balanced and skewed, an expert with no token included (fp32, 1e-5 relative: sum order
only). The bytes autograd keeps for backward are those of the routed rows alone, whatever the
skew: no expert is padded to the busiest one's count. On a CUDA device where the grouped path is
``torch._grouped_mm`` it must compute what the loop does.
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.moe.experts import GroupedExperts, grouped_mm_serves
from megalite.measure.saved_tensors import SavedTensorMeter
from tests.core.moe.cases import moe_config

H, F_, E = 16, 8, 4
N = 40  # routed rows on this rank
COUNTS = {
    "balanced": [10, 10, 10, 10],
    "skewed": [28, 12, 0, 0],  # 70% to one expert, two idle
}


def _experts(*, swiglu: bool, grouped: bool, dtype=torch.float32, device=None) -> GroupedExperts:
    config = moe_config(
        num_experts=E, hidden_size=H, ffn_hidden_size=F_, swiglu=swiglu, grouped_gemm=grouped
    )
    config.params_dtype = dtype

    def init(key: str):
        g = torch.Generator().manual_seed(hash(key) % 2**31)
        return lambda w: w.copy_(torch.randn(w.shape, generator=g) * 0.3)

    return GroupedExperts(
        config,
        ep_rank=0,
        ep_size=1,
        etp_group=None,
        init_fc1=lambda e: init(f"fc1.{e}"),
        init_fc2=lambda e: init(f"fc2.{e}"),
        device=device,
    )


def _oracle(experts: GroupedExperts, x: torch.Tensor, counts: list[int], dy: torch.Tensor):
    """Output and grads in float64, one expert at a time from the full weights."""
    w1 = experts.weight1.detach().double().requires_grad_()
    w2 = experts.weight2.detach().double().requires_grad_()
    x = x.detach().double().requires_grad_()
    outs, start = [], 0
    for i, n in enumerate(counts):
        y = x[start : start + n] @ w1[i].t()
        if experts.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        else:
            y = torch.nn.functional.gelu(y)
        outs.append(y @ w2[i].t())
        start += n
    out = torch.cat(outs)
    out.backward(dy.double())
    return out, x.grad, w1.grad, w2.grad


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max diff {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_experts_equal_the_oracle(grouped, swiglu, routing):
    counts = COUNTS[routing]
    experts = _experts(swiglu=swiglu, grouped=grouped)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, H, generator=g).requires_grad_()
    dy = torch.randn(N, H, generator=g)
    out = experts(x, counts)
    out.backward(dy)
    want = _oracle(experts, x, counts, dy)
    for got, expected, what in zip(
        (out, x.grad, experts.weight1.grad, experts.weight2.grad), want, ("out", "x", "w1", "w2")
    ):
        _close(got.detach(), expected, f"{routing} {what}")


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_saved_activations_are_the_routed_rows_whatever_the_skew(grouped, swiglu):
    """Per routed row: its input [h], the fc1 output [f1] and the activation's output [f]
    (SwiGLU: fc1 [2f], silu(gate) [f], the product [f]); fp32. The same bytes balanced and
    skewed, where padding to the busiest expert would keep E x 28 rows instead of 40."""
    per_row = (H + 4 * F_ if swiglu else H + 2 * F_) * 4
    for routing, counts in COUNTS.items():
        experts = _experts(swiglu=swiglu, grouped=grouped)
        x = torch.randn(N, H).requires_grad_()
        with SavedTensorMeter([x, *experts.parameters()]) as meter:
            out = experts(x.clone(), counts)
        assert meter.peak == N * per_row, (routing, meter.peak, N * per_row)
        out.sum().backward()


def test_the_fused_grouped_kernel_is_never_taken_off_cuda():
    experts = _experts(swiglu=True, grouped=True, dtype=torch.bfloat16)
    x = torch.randn(N, H, dtype=torch.bfloat16)
    assert not grouped_mm_serves(x, experts.weight1, experts.weight2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grouped_equals_the_loop_on_cuda(dtype):
    """Where ``torch._grouped_mm`` serves (sm90+; bf16, and fp16/fp32 from torch 2.11) it
    computes what the loop does (bit-identical on an H100 with torch 2.11; the bar allows
    another accumulation order: fp32 1e-5, half precision 2e-2); elsewhere both are the loop."""
    device = torch.device("cuda")
    loop = _experts(swiglu=True, grouped=False, dtype=dtype, device=device)
    grouped = _experts(swiglu=True, grouped=True, dtype=dtype, device=device)
    counts = COUNTS["skewed"]
    x = torch.randn(N, H, device=device, dtype=dtype)
    dy = torch.randn(N, H, device=device, dtype=dtype)
    results = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.backward(dy)
        results.append((out, xi.grad, experts.weight1.grad, experts.weight2.grad))
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want, what in zip(results[1], results[0], ("out", "x", "w1", "w2")):
        _close(got.float(), want.double(), f"{dtype} {what}", rel=rel)
