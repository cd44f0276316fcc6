"""Each tensor-parallel mode's rule for cutting a logical tensor (``tp_shards``), held against the
layers themselves.

- Layers: on 8 ranks, ``GPTModel`` under 2.5d (d = 2, q = 2) and 3d (q = 2), and 2d TP 4 x DP 2,
  its parameters set to ``split_shard`` of a one-process model whose every parameter is random
  (norm scales and biases included, so a wrong block of any tensor changes the function): the
  per-token loss equals the one-process model's (fp32, 1e-5 relative: only the order of sums
  differs), and ``merge_shards`` of the TP ranks' blocks gives back every full tensor exactly.
- Round trip, one process: for every mode, merging the split of every parameter gives it back,
  and a rank's block differs from its neighbours' where the mode says it is distinct.
GPT-2 (LayerNorm, biases, learned positions, tied output) and Llama (RMSNorm, SwiGLU's strided
fc1, GQA, untied output) both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.tp_shards import TPLayout, is_vocab, merge_shards, split_shard
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, rel_err

TOL = 1e-5
BATCH = 4  # d x q = q^2 = 4 blocks of whole sequences
LAYOUTS = {
    "1d": TPLayout("1d", 4),
    "2d": TPLayout("2d", 4),
    "2.5d": TPLayout("2.5d", 8, 2),
    "3d": TPLayout("3d", 8),
}


def _random_model(family: str) -> tuple[GPTModel, dict[str, torch.Tensor]]:
    """The one-process model with every parameter random, and its logical tensors (the
    vocabulary unpadded)."""
    c = make_config(family)
    model = GPTModel(c, ParallelState.single())
    g = torch.Generator().manual_seed(11)
    full = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            full[name] = p[: c.vocab_size].clone() if is_vocab(name) else p.detach().clone()
    return model, full


def _loss(model: GPTModel, c) -> torch.Tensor:
    tokens, labels, _ = make_batch(c, batch=BATCH)
    positions = torch.arange(c.seq_length)[None].expand(BATCH, -1)
    return model(tokens, positions, labels).detach()


def _layers_case(family: str) -> bool:
    c = make_config(family)
    single, full = _random_model(family)
    want = _loss(single, c)
    for ps in (mesh(8, mode="2.5d", depth=2), mesh(8, mode="3d"), mesh(4, mode="2d")):
        tp = TPLayout.of(ps)
        model = GPTModel(c, ps)
        with torch.no_grad():
            for name, p in model.named_parameters():
                split = split_shard(
                    full[name],
                    name,
                    tp,
                    tp_rank=ps.tp_rank,
                    swiglu=c.swiglu,
                    padded_vocab_size=model.padded_vocab_size,
                )
                p.copy_(split)
        got = _loss(model, c)
        assert rel_err(got, want) < TOL, (family, str(tp), rel_err(got, want))
        blocks = [None] * ps.tp_size
        mine = {n: p.detach() for n, p in model.named_parameters()}
        dist.all_gather_object(blocks, mine, group=ps.tp_group)
        for name, tensor in full.items():
            shards = [b[name] for b in blocks]
            merged = merge_shards(shards, name, tp, swiglu=c.swiglu, vocab_size=c.vocab_size)
            assert torch.equal(merged, tensor), (family, str(tp), name)
        ps.destroy()
    return True


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_of_every_grid_mode_are_the_layers_blocks(family):
    assert run_distributed(_layers_case, 8, family, timeout=600) == [True] * 8


@pytest.mark.parametrize("mode", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_merge_of_split_gives_every_tensor_back(family, mode):
    tp = LAYOUTS[mode]
    c = make_config(family)
    _, full = _random_model(family)
    padded = c.padded_vocab_size(tp.q)
    for name, tensor in full.items():
        shards = [
            split_shard(tensor, name, tp, tp_rank=r, swiglu=c.swiglu, padded_vocab_size=padded)
            for r in range(tp.size)
        ]
        merged = merge_shards(shards, name, tp, swiglu=c.swiglu, vocab_size=c.vocab_size)
        assert torch.equal(merged, tensor), (name, mode)
        distinct = {tuple(s.flatten().tolist()) for s in shards}
        assert len(distinct) > 1 or tp.mode == "1d", (name, mode, "every rank holds one block")
