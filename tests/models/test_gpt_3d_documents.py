"""``GPTModel`` under 3d TP 8 (q = 2) equals the one-process model on a batch whose sequences hold
several documents: per-sample position ids (reset at each document) and the documents' attention
mask. Under 3d the embedding's positions are the residual layout's batch block and RoPE's and the
mask's the inner layout's (``Mode3D.residual_block`` / ``attention_block``), which differ on half
the ranks; the same blocks everywhere would pair a sequence with another's positions or mask.

Checked: the per-token loss of the whole micro-batch on every rank, and the grad norm (each
parameter counted on the TP ranks of its ``distinct_tp_ranks``, summed over the world) against the
one-process grad norm. Tolerance 1e-5 relative (``tests/models``' bar)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.optimizer.grad_norm import param_is_counted
from megalite.core.parallel_state import ParallelState
from megalite.data.gpt_dataset import document_attention_mask
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err

TOL = 1e-5
BATCH = 4  # q^2 blocks of one sequence each


def _documents(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and positions # [b, s]: sequence i starts a new document at 2 + 3 i."""
    doc = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        doc[i, 2 + 3 * i :] = 1
    start = torch.where(doc == 1, (2 + 3 * torch.arange(b))[:, None], 0)
    return doc, torch.arange(s)[None] - start


def _run(family: str, ps: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    c = make_config(family)
    model = GPTModel(c, ps)
    tokens, labels, weights = make_batch(c, batch=BATCH)
    doc, positions = _documents(BATCH, c.seq_length)
    loss = model(tokens, positions, labels, attention_mask=document_attention_mask(doc))
    (loss * weights).sum().backward()
    sq = sum(
        p.grad.pow(2).sum()
        for p in model.parameters()
        if param_is_counted(p, tp_rank=ps.tp_rank if ps.tp_size > 1 else 0)
    )
    return loss.detach(), sq


def _case(family: str) -> bool:
    loss, sq = _run(family, mesh(8, mode="3d"))
    dist.all_reduce(sq)
    ref_loss, ref_sq = _run(family, ParallelState.single())
    assert rel_err(loss, ref_loss) < TOL, (family, rel_err(loss, ref_loss))
    assert rel_err(sq, ref_sq) < TOL, (family, sq.item(), ref_sq.item())
    return True


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_3d_gpt_with_documents_equals_one_process(family):
    assert run_distributed(_case, 8, family) == [True] * 8
