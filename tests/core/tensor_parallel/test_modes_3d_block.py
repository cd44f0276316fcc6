"""A whole transformer layer (norm, attention, norm, MLP, two residuals) under 3D TP at TP 8
(q = 2) equals the unsharded layer: GPT-2's (LayerNorm, biases, GELU, multi-head) and Llama's
(RMSNorm, no biases, SwiGLU, grouped-query attention with RoPE).

The oracle is the same layer written in plain torch on the full weights (``F.linear``, torch's
norms, ``F.scaled_dot_product_attention``), the fused QKV weight laid out per query group as in
1D; outputs and every grad (input and each parameter) are compared through the chunk slicing of
``test_modes_3d_layers.py``. Tolerance: fp32, norm-wise relative error 1e-5 per tensor, the
whole-model bar of ``tests/models`` (only the order of sums differs; element-wise, a grad entry
where terms cancel is off by 1e-4 relative even at q = 1, from the norms' own rounding alone).
The bytes each rank sends, counted at the collectives, equal ``block3d_bytes``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.op_record import RECORDER
from megalite.core.tensor_parallel.init import init_normal
from megalite.core.tensor_parallel.modes.block3d import MLP3D, SelfAttention3D
from megalite.core.tensor_parallel.modes.cost3d import block3d_bytes
from megalite.core.tensor_parallel.modes.grid3d import Groups3D
from megalite.core.tensor_parallel.modes.layers3d import LayerNorm3D, RMSNorm3D
from tests.core.tensor_parallel.test_modes_3d_layers import (
    act_block,
    full_tensor,
    groups3d,
    record,
    sent_bytes,
    weight_block,
)
from tests.harness import run_distributed
from tests.models.helpers import rel_err

TOL = 1e-5
S, B, H, HEADS, FFN = 4, 4, 16, 4, 32
STD = 0.2  # weights of a trained model's scale: std 0.5 puts the softmax near one-hot, where
# the grads cancel and fp32 rounding alone reaches 2e-5 relative (seen on one process, q = 1)
FAMILIES = {
    "gpt2": dict(kv=HEADS, rms=False, bias=True, swiglu=False, rope=False),
    "llama": dict(kv=2, rms=True, bias=False, swiglu=True, rope=True),
}


def rope(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half) of ``[s, b, heads, d]``, positions 0 .. s-1."""
    s, d = query.shape[0], query.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # [s, d/2]
    cos = torch.cat([angles.cos()] * 2, dim=-1)[:, None, None, :]
    sin = torch.cat([angles.sin()] * 2, dim=-1)[:, None, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rotate(query), rotate(key)


class Block3D(nn.Module):
    """The layer under test, assembled from the 3D pieces (residual layout in and out)."""

    def __init__(self, g: Groups3D, family: str, prefix: str | None = None):
        super().__init__()
        f = FAMILIES[family]
        norm = RMSNorm3D if f["rms"] else LayerNorm3D
        key = lambda name: init_normal(STD, seed=7, key=f"{prefix or family}.{name}")
        self.norm1, self.norm2 = norm(H, g), norm(H, g)
        self.attention = SelfAttention3D(
            H,
            HEADS,
            g,
            num_query_groups=f["kv"],
            bias=f["bias"],
            init_qkv=key("qkv"),
            init_proj=key("proj"),
            rotary=rope if f["rope"] else None,
        )
        self.mlp = MLP3D(
            H,
            FFN,
            g,
            swiglu=f["swiglu"],
            bias=f["bias"],
            init_fc1=key("fc1"),
            init_fc2=key("fc2"),
        )

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def full_params(family: str, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The unsharded parameters (keyed by ``prefix``, default the family's name); biases and norm
    weights random (not their zero / one init)."""
    f, prefix = FAMILIES[family], prefix or family
    qkv = (HEADS + 2 * f["kv"]) * (H // HEADS)
    fc1 = 2 * FFN if f["swiglu"] else FFN
    shapes = {"qkv": (qkv, H), "proj": (H, H), "fc1": (fc1, H), "fc2": (H, FFN)}
    p = {f"{n}.weight": full_tensor(shape, f"{prefix}.{n}", STD) for n, shape in shapes.items()}
    for n, shape in shapes.items():
        if f["bias"]:
            p[f"{n}.bias"] = full_tensor(shape[:1], f"{prefix}.{n}.bias")
    for n in ("norm1", "norm2"):
        p[f"{n}.weight"] = 1 + 0.3 * full_tensor((H,), f"{prefix}.{n}.weight")
        if not f["rms"]:
            p[f"{n}.bias"] = full_tensor((H,), f"{prefix}.{n}.bias")
    return p


def reference_norm(y: torch.Tensor, p: dict[str, torch.Tensor], name: str, family: str):
    if FAMILIES[family]["rms"]:
        return F.rms_norm(y, (H,), p[f"{name}.weight"], eps=1e-5)
    return F.layer_norm(y, (H,), p[f"{name}.weight"], p[f"{name}.bias"], eps=1e-5)


def reference(x: torch.Tensor, p: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    """The layer on one process, on the full parameters."""
    f = FAMILIES[family]
    norm = lambda y, name: reference_norm(y, p, name, family)

    def linear(y, name):
        return F.linear(y, p[f"{name}.weight"], p.get(f"{name}.bias"))

    d, per = H // HEADS, HEADS // f["kv"]
    qkv = linear(norm(x, "norm1"), "qkv").view(S, B, f["kv"], per + 2, d)  # per query group
    query, key, value = (
        qkv[:, :, :, :per].reshape(S, B, HEADS, d),
        qkv[..., per, :],
        qkv[..., -1, :],
    )
    if f["rope"]:
        query, key = rope(query, key)
    key, value = key.repeat_interleave(per, dim=2), value.repeat_interleave(per, dim=2)
    attn = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True
    )
    x = x + linear(attn.permute(2, 0, 1, 3).reshape(S, B, H), "proj")
    y = linear(norm(x, "norm2"), "fc1")
    if f["swiglu"]:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    else:
        y = F.gelu(y)
    return x + linear(y, "fc2")


# parameter of Block3D -> (full name, layout the linear takes or None for a norm, stride)
def where3d(family: str) -> dict[str, tuple[str, str | None, int]]:
    stride = 2 if FAMILIES[family]["swiglu"] else 1
    out = {}
    for kind in ("weight", "bias"):
        out[f"attention.linear_qkv.{kind}"] = (f"qkv.{kind}", "residual", 1)
        out[f"attention.linear_proj.{kind}"] = (f"proj.{kind}", "inner", 1)
        out[f"mlp.linear_fc1.{kind}"] = (f"fc1.{kind}", "residual", stride)
        out[f"mlp.linear_fc2.{kind}"] = (f"fc2.{kind}", "inner", 1)
        out[f"norm1.{kind}"] = (f"norm1.{kind}", None, 1)
        out[f"norm2.{kind}"] = (f"norm2.{kind}", None, 1)
    return out


def block_of(full: torch.Tensor, g: Groups3D, layout: str | None, stride: int) -> torch.Tensor:
    if layout is None:  # a norm's [h]: the residual layout's hidden block
        return full.chunk(g.q)[g.output_rank]
    return weight_block(full, g, layout, stride=stride)


def _check_block(g: Groups3D, family: str):
    f = FAMILIES[family]
    layer = Block3D(g, family)
    p = {n: t.clone().requires_grad_() for n, t in full_params(family).items()}
    where = where3d(family)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            full, layout, stride = where[name]
            if name.endswith("weight") and layout is not None:  # keyed init: must already match
                torch.testing.assert_close(
                    param, block_of(p[full], g, layout, stride), rtol=0, atol=0
                )
            param.copy_(block_of(p[full], g, layout, stride))
    x = full_tensor((S, B, H), "x").requires_grad_()
    dy = full_tensor((S, B, H), "dy")
    y_ref = reference(x, p, family)
    y_ref.backward(dy)

    x_mine = act_block(x.detach(), g, "residual").requires_grad_()
    record()
    y = layer(x_mine)
    y.backward(act_block(dy, g, "residual"))
    sent = sent_bytes()
    RECORDER.disable()
    assert rel_err(y, act_block(y_ref.detach(), g, "residual")) < TOL
    assert rel_err(x_mine.grad, act_block(x.grad, g, "residual")) < TOL
    names = [name for name, _ in layer.named_parameters()]
    assert len(names) == len(p)  # every parameter of the oracle has its block here
    for name, param in layer.named_parameters():
        full, layout, stride = where[name]
        assert rel_err(param.grad, block_of(p[full].grad, g, layout, stride)) < TOL, name
    qkv = (HEADS + 2 * f["kv"]) * (H // HEADS)
    expected = block3d_bytes(
        S * B, H, FFN, g.q, qkv_size=qkv, bias=f["bias"], swiglu=f["swiglu"], rms=f["rms"]
    )
    assert sent == pytest.approx(expected, rel=1e-12)


def _block_cases(q: int):
    g = groups3d(q) if q > 1 else Groups3D.single()
    for family in FAMILIES:
        _check_block(g, family)
    return True


def test_block_3d_equals_unsharded_at_tp8():
    assert run_distributed(_block_cases, 8, 2) == [True] * 8


def test_block_3d_in_one_process():
    assert _block_cases(1)
