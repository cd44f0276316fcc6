"""A small GPT under 3D TP at TP 8 (q = 2): embedding (and GPT-2's learned positions), two
transformer layers, the final norm, the output layer and the mean cross-entropy equal one process,
the loss and every parameter's grad, for GPT-2's and Llama's layers; the bytes each rank sends in
the step, counted at the collectives, equal the sum of ``cost3d.py``'s closed forms; the grad
norm, each replicated parameter counted once (``holds_first_copy``), equals the unsharded one.

The model is assembled here from the 3D pieces (a test-only assembly, the shape of the wiring the
model needs); the oracle is the same network in plain torch (``test_modes_3d_block.reference``)
on the full weights, sliced with chunk. Tolerance: norm-wise relative error 1e-5 per tensor, as
the block test and ``tests/models``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.core.op_record import RECORDER
from megalite.core.tensor_parallel import padded_vocab_size, reduce_from_tp_region
from megalite.core.tensor_parallel.init import init_normal
from megalite.core.tensor_parallel.modes.cost3d import (
    block3d_bytes,
    cross_entropy3d_bytes,
    embedding3d_bytes,
    linear3d_bytes,
    norm3d_bytes,
    position3d_bytes,
)
from megalite.core.tensor_parallel.modes.grid3d import Groups3D
from megalite.core.tensor_parallel.modes.layers3d import LayerNorm3D, Linear3D, RMSNorm3D
from megalite.core.tensor_parallel.modes.vocab3d import (
    PositionEmbedding3D,
    VocabEmbedding3D,
    cross_entropy_3d,
)
from tests.core.tensor_parallel.test_modes_3d_block import (
    FAMILIES,
    FFN,
    HEADS,
    STD,
    B,
    Block3D,
    H,
    S,
    block_of,
    full_params,
    reference,
    reference_norm,
    where3d,
)
from tests.core.tensor_parallel.test_modes_3d_layers import (
    full_tensor,
    groups3d,
    record,
    sent_bytes,
    weight_block,
)
from tests.harness import run_distributed
from tests.models.helpers import rel_err

TOL = 1e-5
VOCAB, LAYERS, MAX_POS = 14, 2, 8


def _v_pad(q: int) -> int:
    return padded_vocab_size(VOCAB, make_vocab_size_divisible_by=1, tp_size=q * q)


class GPT3D(nn.Module):
    def __init__(self, g: Groups3D, family: str):
        super().__init__()
        f, self.g = FAMILIES[family], g
        key = lambda name: init_normal(STD, seed=7, key=f"gpt.{family}.{name}")
        self.embedding = VocabEmbedding3D(
            _v_pad(g.q), H, g, init_method=key("emb"), init_rows=VOCAB
        )
        self.position = (
            None if f["rope"] else PositionEmbedding3D(MAX_POS, H, g, init_method=key("pos"))
        )
        self.layers = nn.ModuleList(
            Block3D(g, family, prefix=f"gpt.{family}.{i}") for i in range(LAYERS)
        )
        self.final_norm = (RMSNorm3D if f["rms"] else LayerNorm3D)(H, g)
        self.output = Linear3D(
            H, _v_pad(g.q), g, input_layout="residual", bias=False, init_method=key("out")
        )

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)  # [s, b/q^2, h/q], residual layout
        if self.position is not None:
            x = x + self.position(ids.shape[0])
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.final_norm(x))  # [s, b/q^2, V_pad/q], inner layout
        losses = cross_entropy_3d(logits, target, self.g, vocab_size=VOCAB)  # [s, b/q^2]
        # the q^2 batch blocks are spread over the output and weight groups (the input group
        # holds copies): sum them; every rank then back-propagates the same loss once
        total = reduce_from_tp_region(losses.sum(), self.g.output_group)
        return reduce_from_tp_region(total, self.g.weight_group) / target.numel()


def _full_model(family: str, q: int) -> dict[str, torch.Tensor]:
    p = {
        "emb": full_tensor((VOCAB, H), f"gpt.{family}.emb", STD),
        "out": full_tensor((_v_pad(q), H), f"gpt.{family}.out", STD),
        "final.weight": 1 + 0.3 * full_tensor((H,), f"gpt.{family}.final.weight"),
    }
    if not FAMILIES[family]["rms"]:
        p["final.bias"] = full_tensor((H,), f"gpt.{family}.final.bias")
    if not FAMILIES[family]["rope"]:
        p["pos"] = full_tensor((MAX_POS, H), f"gpt.{family}.pos", STD)
    for i in range(LAYERS):
        for name, t in full_params(family, prefix=f"gpt.{family}.{i}").items():
            p[f"{i}.{name}"] = t
    return {n: t.clone().requires_grad_() for n, t in p.items()}


def _reference_loss(ids, target, p, family) -> torch.Tensor:
    x = F.embedding(ids, p["emb"])  # [s, b, h]
    if "pos" in p:
        x = x + p["pos"][: ids.shape[0]].unsqueeze(1)
    for i in range(LAYERS):
        x = reference(
            x, {n[len(f"{i}.") :]: t for n, t in p.items() if n.startswith(f"{i}.")}, family
        )
    logits = F.linear(reference_norm(x, p, "final", family), p["out"][:VOCAB])
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _block3d(name: str, full: dict[str, torch.Tensor], g: Groups3D, family: str) -> torch.Tensor:
    """This rank's block of model parameter ``name``, cut from the full tensors ``full`` (the
    oracle's parameters or their grads) with chunk."""
    q = g.q
    if name == "embedding.weight":  # vocab block input_rank, hidden block (output, weight)
        padded = torch.cat([full["emb"], torch.zeros(_v_pad(q) - VOCAB, H)])
        return padded.chunk(q)[g.input_rank].chunk(q * q, dim=1)[g.output_rank * q + g.weight_rank]
    if name == "position.weight":
        return full["pos"].chunk(q, dim=1)[g.output_rank]
    if name.startswith("final_norm."):
        return full[f"final.{name.split('.')[-1]}"].chunk(q)[g.output_rank]
    if name == "output.weight":
        return weight_block(full["out"], g, "residual")
    _, i, rest = name.split(".", 2)  # layers.<i>.<name in Block3D>
    where, layout, stride = where3d(family)[rest]
    return block_of(full[f"{i}.{where}"], g, layout, stride)


def _model_bytes(family: str, q: int) -> float:
    """The closed forms of ``cost3d.py`` summed over the model, and the loss's two all-reduces
    of one element (the sum of the batch blocks)."""
    f, m = FAMILIES[family], S * B
    qkv = (HEADS + 2 * f["kv"]) * (H // HEADS)
    layer = block3d_bytes(
        m, H, FFN, q, qkv_size=qkv, bias=f["bias"], swiglu=f["swiglu"], rms=f["rms"]
    )
    return (
        embedding3d_bytes(m, _v_pad(q), H, q)
        + (0 if f["rope"] else position3d_bytes(S, H, q))
        + LAYERS * layer
        + norm3d_bytes(m, H, q, rms=f["rms"])
        + linear3d_bytes(m, H, _v_pad(q), q, bias=False)
        + cross_entropy3d_bytes(m, q)
        + 2 * 2 * (q - 1) / q * 4
    )


def _gpt_cases(q: int):
    g = groups3d(q) if q > 1 else Groups3D.single()
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(3))
    ids[0, 0], ids[-1, -1] = 0, VOCAB - 1
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(4))
    for family in FAMILIES:
        model = GPT3D(g, family)
        p = _full_model(family, q)
        values = {n: t.detach() for n, t in p.items()}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("weight") and "norm" not in name:  # keyed init: equal already
                    assert torch.equal(param, _block3d(name, values, g, family)), name
                param.copy_(_block3d(name, values, g, family))  # biases, norms: not their init
        ref_loss = _reference_loss(ids, target, p, family)
        ref_loss.backward()
        record()
        loss = model(ids, target)
        loss.backward()
        sent = sent_bytes()
        RECORDER.disable()
        expected = _model_bytes(family, q)
        assert sent == pytest.approx(expected, rel=1e-12), ("bytes", family, sent, expected)
        assert rel_err(loss, ref_loss.detach()) < TOL, (family, loss.item(), ref_loss.item())
        assert len(list(model.parameters())) == len(p)  # every oracle tensor has its block
        grads = {n: t.grad for n, t in p.items()}
        for name, param in model.named_parameters():
            assert rel_err(param.grad, _block3d(name, grads, g, family)) < TOL, (family, name)
        # the grad norm, each parameter counted on the first of its copies only
        sq = sum(t.grad.pow(2).sum() for t in model.parameters() if g.holds_first_copy(t))
        if q > 1:
            dist.all_reduce(sq)  # the world is the TP group
        assert rel_err(sq, sum(t.pow(2).sum() for t in grads.values())) < TOL, "grad norm"
    return True


def test_gpt_3d_equals_unsharded_at_tp8():
    assert run_distributed(_gpt_cases, 8, 2) == [True] * 8


def test_gpt_3d_in_one_process():
    assert _gpt_cases(1)
