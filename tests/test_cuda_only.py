"""The CUDA paths that only a GPU can check (scripts/gpu_check.sh runs this file; skipped without
CUDA). Each test states which kernel must serve, and fails if a silent fallback serves instead.

- bf16 attention (``CoreAttention``, backend ``sdpa``) runs with only the flash and
  memory-efficient SDPA kernels allowed, and matches the fp32 math within bf16 rounding;
- context parallelism's block attention takes the memory-efficient kernel with the log-sum-exp
  (forward and backward), not the matmul block, and matches the matmul block;
- the offloaded ZeRO step (host masters, device grads copied with ``non_blocking``) on a world of
  one with nccl gives the same params as the all-on-device step;
- activation offload (pinned host copies on a side stream, reloaded with a prefetch of the next
  layer) gives bitwise the loss and grads of the run without it, twice in a row;
- the inner AdamW over CUDA masters is torch's fused kernel (unsharded and ZeRO-1), and trains to
  the losses of the default (foreach) AdamW.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkv(b=2, n=4, s=256, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def test_bf16_sdpa_attention_uses_flash_or_efficient_kernels():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megalite.models.attention import CoreAttention
    from tests.models.helpers import make_config

    config = make_config("gpt2", hidden_size=256, num_attention_heads=4, seq_length=256)
    attn = CoreAttention(config, rng_tracker=None).cuda().eval()
    q, k, v = _qkv(d=config.kv_channels)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = attn(q, k, v)  # raises if neither kernel accepts the inputs
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=attn.scale
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)  # bf16: 8 mantissa bits


@pytest.mark.parametrize("causal", [True, False])
def test_cp_block_attention_takes_the_efficient_kernel_on_cuda(monkeypatch, causal):
    from megalite.core.attention import block_attention as ba

    q, k, v = _qkv(s=128)
    scale = q.shape[-1] ** -0.5
    dout = torch.randn_like(q)
    # the matmul block, the reference (fp32 math on the same bf16 inputs)
    monkeypatch.setattr(ba, "_cuda_ok", lambda *a: False)
    out_ref, lse_ref = ba.block_forward(q, k, v, causal=causal, scale=scale)
    grads_ref = ba.block_backward(dout, q, k, v, out_ref, lse_ref, causal=causal, scale=scale)
    monkeypatch.undo()

    def refuse(*a, **k):
        raise AssertionError("the matmul block served on CUDA: the efficient kernel refused")

    monkeypatch.setattr(ba, "_scores", refuse)
    out, lse = ba.block_forward(q, k, v, causal=causal, scale=scale)
    grads = ba.block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.float(), r.float(), rtol=5e-2, atol=5e-2)


def test_offloaded_step_equals_the_device_step_on_cuda():
    """Half the optimizer state on the host (pinned, non_blocking copies both ways) vs none: the
    same params after a few steps (fp32: the same AdamW math on host and device)."""
    from megalite.core.parallel_state import ParallelState, init_single_process
    from megalite.training.forward_step import make_forward_step
    from megalite.training.pretrain import build_run
    from tests.training.common import config

    device = torch.device("cuda", torch.cuda.current_device())
    if not torch.distributed.is_initialized():
        init_single_process(device)
    ps = ParallelState.single(device)

    def losses(*flags: str) -> list[float]:
        cfg = config(
            "--use-distributed-optimizer", "--train-iters", "3", "--device", "cuda", *flags
        )
        run = build_run(cfg, ps, device, seed_rng=False, resume=False)
        return run.trainer.train(make_forward_step(device), run.train_iter).losses

    plain = losses()
    off = losses("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5")
    assert len(plain) == 3
    for a, b in zip(off, plain):
        assert abs(a - b) <= 1e-5 * abs(b), (off, plain)


@pytest.mark.parametrize("flags", [(), ("--use-distributed-optimizer",)], ids=["plain", "zero1"])
def test_adamw_on_cuda_masters_is_fused_and_trains_as_the_default(monkeypatch, flags):
    from megalite.core.optimizer import builders
    from megalite.core.parallel_state import ParallelState, init_single_process
    from megalite.training.forward_step import make_forward_step
    from megalite.training.pretrain import build_run
    from tests.training.common import config

    device = torch.device("cuda", torch.cuda.current_device())
    if not torch.distributed.is_initialized():
        init_single_process(device)
    ps = ParallelState.single(device)

    def run() -> tuple[list[bool], list[float]]:
        cfg = config("--train-iters", "4", "--device", "cuda", *flags)
        r = build_run(cfg, ps, device, seed_rng=False, resume=False)
        fused = [bool(g.get("fused")) for g in r.trainer.optimizer.optimizer.param_groups]
        return fused, r.trainer.train(make_forward_step(device), r.train_iter).losses

    fused, losses = run()
    monkeypatch.setattr(builders, "fused_adam_serves", lambda groups: False)
    default, expected = run()
    assert fused and all(fused), fused
    assert not any(default), default
    assert len(losses) == 4
    for a, b in zip(losses, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, expected)


def test_activation_offload_on_cuda_equals_no_offload():
    from megalite.core.parallel_state import ParallelState
    from megalite.models import GPTModel
    from tests.models.helpers import make_batch, make_config

    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for n in (0, 2):
        config = make_config(
            "llama", num_layers=3, cpu_offloading=n > 0, cpu_offloading_num_layers=n
        )
        torch.manual_seed(0)
        model = GPTModel(config, ParallelState.single(device), device=device)
        tokens, labels, weights = (t.to(device) for t in make_batch(config))
        for _ in range(2):  # a second step reuses the side stream and the pinned blocks
            model.zero_grad()
            loss = model(tokens, None, labels)
            (loss * weights).sum().backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        if n:
            moved = model.decoder.activation_offload.moved_bytes
            assert set(moved) == {0, 1} and all(moved.values()), moved
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _flex_cases(s: int):
    from megalite.core.attention.masks import MaskSpec
    from megalite.core.attention.sparse_layouts import build_layout

    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([s // 3, s // 2, s - 5 * s // 6]))
    bigbird = build_layout("bigbird", num_window_blocks=3, num_global_blocks=1, num_random_blocks=2)
    return {
        "window": (MaskSpec(window=(300, 0)), None),
        "bigbird": (MaskSpec(layout=bigbird, layout_block=128), None),
        "longformer": (
            MaskSpec(
                layout=build_layout("longformer", num_window_blocks=3, global_blocks=(0,)),
                layout_block=128,
            ),
            None,
        ),
        "documents+window": (MaskSpec(window=(200, 0)), docs.cuda()),
    }


@pytest.mark.parametrize(
    "name, block",
    [
        ("window", 128),
        ("bigbird", 128),
        ("longformer", 128),
        ("documents+window", 128),
        ("window", 64),  # 64-token plans run on flex's 128-token blocks, grouped
        ("documents+window", 64),
    ],
)
def test_flex_plan_attention_equals_the_block_path_on_cuda(name, block):
    """Compiled flex attention on a plan's BlockMask (sequence 1000: not a multiple of the block)
    gives the block path's output and grads in fp32."""
    from megalite.core.attention.block_sparse import block_sparse_attention
    from megalite.core.attention.flex_sparse import flex_plan_attention
    from megalite.core.attention.masks import build_block_plan

    s = 1000
    spec, docs = _flex_cases(s)[name]
    pos = torch.arange(s, device="cuda")
    plan = build_block_plan(spec, pos, pos, block_size=block, q_doc=docs, k_doc=docs)
    results = []
    for attend in (flex_plan_attention, block_sparse_attention):
        q, k, v = (t.requires_grad_() for t in _qkv(b=1, s=s, dtype=torch.float32))
        out = attend(q, k, v, [plan], scale=0.125)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        results.append((out.detach(), *grads))
    for got, want in zip(*results):
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), (name, err)
