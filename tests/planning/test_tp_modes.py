"""Each tensor-parallel mode's bytes per device per layer: the collectives one transformer layer's
forward and backward issue on every rank (``CommLog``: op, group size, bytes) are exactly those of
the closed form ``planning.tp_modes.layer_comms``, for 1d (TP 4), 2d (TP 4), 2.5d (TP 8,
depth 2) and 3d (TP 8, q = 2), both families; and the per-device bytes equal the README's formula
(3d: ``cost3d``'s).

Activations: what a layer's forward saves for backward on a device (saved-tensor hooks,
``SavedTensorMeter``) under a ``d x q x q`` grid is the unsharded grid layer's (q = d = 1, one
process) divided by ``d q^2``, except each norm's ``[T, 1]`` statistic, which only the batch
blocks split (``/ (d q)``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.core.tensor_parallel.modes.cost3d import block3d_bytes
from megalite.measure.comm_log import CommLog
from megalite.measure.saved_tensors import SavedTensorMeter
from megalite.models.config import GPTConfig
from megalite.models.transformer import TransformerLayer
from megalite.planning.tp_modes import bytes_per_device, layer_comms, layer_param_elements
from megalite.planning.traffic import counts
from tests.harness import run_distributed
from tests.mesh import mesh

S, B = 4, 4
FAMILY = {
    "gpt2": {},
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        ffn_hidden_size=24,
        num_attention_heads=8,
        num_query_groups=4,
        add_bias_linear=False,
        position_embedding_type="rope",
    ),
}


def _config(family: str) -> GPTConfig:
    return GPTConfig(
        num_layers=1,
        hidden_size=16,
        vocab_size=32,
        seq_length=S,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **{"num_attention_heads": 4, **FAMILY[family]},
    )


def _layer_case(
    family: str, mode: str, tp: int, depth: int, dtype: torch.dtype = torch.float32
) -> Counter:
    c = _config(family)
    ps = mesh(tp, mode=mode, depth=depth)
    layer = TransformerLayer(c, ps, layer_number=0, rng_tracker=None).to(dtype)
    batch_split, hidden_split = tensor_parallel_mode(ps).activation_split
    shape = (S, B // batch_split, c.hidden_size // hidden_split)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    with CommLog() as log:
        layer(x).sum().backward()
    return log.counts()


CASES = {"1d": ("1d", 4, 1), "2d": ("2d", 4, 1), "2.5d": ("2.5d", 8, 2), "3d": ("3d", 8, 1)}


@pytest.mark.parametrize("family", sorted(FAMILY))
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_collectives_are_the_closed_form(family, case):
    mode, tp, depth = CASES[case]
    fwd, bwd = layer_comms(_config(family), mode=mode, tp=tp, depth=depth, micro_batch_size=B, e=4)
    expected = counts(fwd + bwd)
    for rank, got in enumerate(run_distributed(_layer_case, tp, family, mode, tp, depth)):
        assert got == expected, (rank, got, expected)


def test_bytes_per_device_follow_the_readme_formulas():
    """GPT-2 shapes (ffn 4h, heads x head dim = h, biases, LayerNorm): the linears' terms of the
    README plus the norms' and the biases' small all-reduces."""
    c = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=8, vocab_size=32, seq_length=32)
    s, b, h, e = 32, 8, 64, 4
    for mode, tp, d in [("1d", 4, 1), ("2d", 4, 1), ("2d", 16, 1), ("2.5d", 8, 2), ("2.5d", 32, 2)]:
        got = bytes_per_device(
            sum(layer_comms(c, mode=mode, tp=tp, depth=d, micro_batch_size=b, e=e), [])
        )
        if mode == "1d":
            assert got == 4 * 2 * (tp - 1) / tp * s * b * h * e
            continue
        q = round((tp // d) ** 0.5)
        t = s * b / (d * q)
        linears = (
            3 * (q - 1) / q * (7 * t * h + 12 * h * h / q) + 2 * (d - 1) / d * 12 * h * h / q**2
        )
        norms = 2 * 2 * 2 * (q - 1) / q * t * 2  # 2 norms x (mean, variance) x fwd and bwd
        small = (
            2 * (d * q - 1) / (d * q) * (3 * h + h + 4 * h + h + 4 * h / 1) / q
        )  # biases, scales
        assert got == pytest.approx((linears + norms + small) * e, rel=1e-12), (mode, tp, d)


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_3d_layer_bytes_are_cost3d_closed_form(family):
    """The 3d layer's collectives (checked against a real step above) send what ``cost3d``'s
    closed form for a transformer block says, at q = 2 for two micro-batch sizes."""
    c = _config(family)
    qkv = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
    for q, b in [(2, B), (2, 8)]:
        comms = sum(layer_comms(c, mode="3d", tp=q**3, micro_batch_size=b, e=4), [])
        expected = block3d_bytes(
            S * b,
            c.hidden_size,
            c.ffn_hidden_size,
            q,
            qkv_size=qkv,
            bias=c.add_bias_linear,
            swiglu=c.swiglu,
            rms=c.normalization == "RMSNorm",
        )
        assert bytes_per_device(comms) == pytest.approx(expected, rel=1e-12), (family, q)


def _saved_case(family: str, mode: str, tp: int, depth: int) -> int:
    c = _config(family)
    ps = mesh(tp, mode=mode, depth=depth)
    layer = TransformerLayer(c, ps, layer_number=0, rng_tracker=None)
    batch_split, hidden_split = tensor_parallel_mode(ps).activation_split
    x = torch.randn(S, B // batch_split, c.hidden_size // hidden_split, requires_grad=True)
    with SavedTensorMeter(layer.parameters()) as meter:
        layer(x)
    return meter.peak


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_saved_activations_per_device_follow_the_grid(family):
    (whole,) = run_distributed(_saved_case, 1, family, "2d", 1, 1)  # the grid of one
    stats = 2 * S * B * 4  # two norms' [T, 1] fp32 statistic, T = s b tokens
    for mode, tp, depth in [("2d", 4, 1), ("2.5d", 8, 2)]:
        q = round((tp // depth) ** 0.5)
        expected = (whole - stats) // (depth * q * q) + stats // (depth * q)
        got = run_distributed(_saved_case, tp, family, mode, tp, depth)
        assert got == [expected] * tp, (mode, got, expected, whole)


def _param_case(family: str, mode: str, tp: int, depth: int) -> int:
    ps = mesh(tp, mode=mode, depth=depth)
    layer = TransformerLayer(_config(family), ps, layer_number=0, rng_tracker=None)
    return sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_layer_parameters_per_device_are_the_closed_form(family):
    for mode, tp, depth in CASES.values():
        expected = layer_param_elements(_config(family), mode=mode, tp=tp, depth=depth)
        got = run_distributed(_param_case, tp, family, mode, tp, depth)
        assert got == [expected] * tp, (mode, got, expected)


@pytest.mark.parametrize("case", ["2d", "2.5d", "3d"])
def test_bf16_layers_sum_their_grads_and_statistics_in_fp32(case):
    """In bf16 the activations and weights travel in 2 bytes, the sums of weight, bias and
    norm-scale grads and the norms' statistics in 4 (``tp_modes.FP32``)."""
    mode, tp, depth = CASES[case]
    fwd, bwd = layer_comms(_config("gpt2"), mode=mode, tp=tp, depth=depth, micro_batch_size=B, e=2)
    expected = counts(fwd + bwd)
    got = run_distributed(_layer_case, tp, "gpt2", mode, tp, depth, torch.bfloat16)
    for rank, counted in enumerate(got):
        assert counted == expected, (rank, counted, expected)
