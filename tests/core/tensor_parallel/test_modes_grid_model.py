"""megalite's GPT under a grid tensor-parallel mode (2d TP 4 = 2 x 2; 2.5d TP 8 = depth 2 x 2 x 2)
equals the same GPT in one process: the loss and every parameter's grad, GPT-2 (learned positions,
LayerNorm, biases, tied embedding) and Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention,
untied output). What the layer tests of ``test_modes_grid.py`` leave to this one: attention with
its heads split over q, RoPE on a batch block, the residual stream and the tied vocabulary table
put together.

Every grid parameter is copied from the one-process parameter of the same name, cut with ``chunk``
by the documented grid layout (``_block``: README "Tensor-parallel modes"), never by a collective;
norm scales and biases are perturbed from their init (ones, zeros) so every path shows. The grids'
grads are compared with the same cut of the one-process grads. Tolerance: norm-wise relative error
1e-5 per tensor (``tests/models``' bar: only the order of sums differs).
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.init import keyed_generator
from megalite.core.tensor_parallel.modes import Grid
from megalite.models import GPTConfig, GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err

TOL = 1e-5
BATCH = 4  # divisible by depth x q = 4 batch blocks
LAYOUTS = {"2d": (4, 1), "2.5d": (8, 2)}  # mode -> (tensor_model_parallel_size, depth)


def _block(name: str, full: torch.Tensor, local: torch.Tensor, g: Grid, c: GPTConfig):
    """This rank's grid block of the one-process tensor ``full`` of parameter ``name`` (``local``:
    the grid's parameter, for the padded vocabulary's size)."""
    q, row, col = g.q, g.row, g.col
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        padded = torch.zeros(local.shape[0] * q, full.shape[1])  # [V_pad, h] of the grid
        padded[: c.vocab_size] = full[: c.vocab_size]
        return padded.chunk(q, 0)[row].chunk(q, 1)[col]  # vocab block row, hidden block col
    if name.endswith("position_embeddings.weight"):
        return full.chunk(q, 1)[col]  # [s, h/q]
    if "layernorm" in name:
        return full.chunk(q)[col]  # [h/q]
    stride = 2 if c.swiglu and "linear_fc1" in name else 1  # [gate; up] stacked
    out = torch.cat([part.chunk(q, 0)[col] for part in full.chunk(stride, 0)])
    return out if name.endswith("bias") else out.chunk(q, 1)[row]  # [out/q, in/q]


def _model_case(mode: str) -> bool:
    tp, depth = LAYOUTS[mode]
    ps = mesh(tp, mode=mode, depth=depth)
    g = Grid.of(ps)
    for family in ("gpt2", "llama"):
        c = make_config(family)
        oracle = GPTModel(c, ParallelState.single())
        with torch.no_grad():
            for name, p in oracle.named_parameters():
                if "layernorm" in name or name.endswith("bias"):
                    p.add_(0.2 * torch.randn(p.shape, generator=keyed_generator(5, name)))
        tokens, labels, weights = make_batch(c, batch=BATCH)
        ref = (oracle(tokens, None, labels) * weights).sum() / weights.sum()
        ref.backward()

        model = GPTModel(c, ps)
        full = dict(oracle.named_parameters())
        assert sorted(n for n, _ in model.named_parameters()) == sorted(full)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_block(name, full[name].detach(), p, g, c))
        loss = (model(tokens, None, labels) * weights).sum() / weights.sum()
        loss.backward()
        assert rel_err(loss, ref.detach()) < TOL, (family, loss.item(), ref.item())
        for name, p in model.named_parameters():
            expected = _block(name, full[name].grad, p, g, c)
            assert rel_err(p.grad, expected) < TOL, (family, name, rel_err(p.grad, expected))
    return True


@pytest.mark.parametrize("mode", sorted(LAYOUTS))
def test_gpt_model_under_a_grid_equals_one_process(mode):
    tp = LAYOUTS[mode][0]
    assert run_distributed(_model_case, tp, mode) == [True] * tp
