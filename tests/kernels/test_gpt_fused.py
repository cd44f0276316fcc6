"""The GPT model computes the same losses and grads through the fused Triton kernels (run on CPU by
triton's interpreter) as through the PyTorch references.

Both families: GPT-2 (LayerNorm) and Llama (RMSNorm), with ``attention_backend="unfused"`` so the
attention probabilities go through the fused scale-mask-softmax too. fp32; tolerance rtol 1e-5 /
atol 1e-6 on the loss and every grad: the kernels reduce in a different order than torch (block
sums, the two-stage dweight), which moves results by a few ulps per op, never by 1e-5.
"""

from __future__ import annotations

import torch

from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.kernels.interpreter import use_triton_interpreter
from tests.models.helpers import make_batch, make_config


def _run(family: str, use_fused: bool):
    config = make_config(
        family, num_layers=2, attention_backend="unfused", use_fused_kernels=use_fused
    )
    model = GPTModel(config, ParallelState.single())
    tokens, labels, weights = make_batch(config, seed=3)
    per_token = model(tokens, None, labels)
    loss = (per_token * weights).sum() / weights.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, per_token.grad_fn


def test_gpt_losses_equal_with_fused_kernels_and_reference(monkeypatch):
    use_triton_interpreter(monkeypatch)
    from megalite.kernels import functions

    calls: dict[str, int] = {}
    for name in ("fused_layer_norm", "fused_rms_norm", "fused_scale_mask_softmax"):
        original = getattr(functions, name)

        def counted(*args, _orig=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(functions, name, counted)

    for family in ("gpt2", "llama"):
        calls.clear()
        fused_loss, fused_grads, _ = _run(family, use_fused=True)
        assert calls, f"{family}: no fused kernel ran; the comparison would be vacuous"
        ran = dict(calls)
        norm = "fused_layer_norm" if family == "gpt2" else "fused_rms_norm"
        assert ran.get(norm) and ran.get("fused_scale_mask_softmax"), ran
        calls.clear()
        ref_loss, ref_grads, _ = _run(family, use_fused=False)
        assert not calls, f"{family}: the reference run used a kernel: {calls}"
        torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(
                fused_grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{family} {name} ({ran})"
            )
