"""Saved activations per rank under context parallel: 1/CP of the unsplit model's.

The bytes of every tensor autograd saves in a GPTModel forward (saved-tensor hooks; storages
counted once, parameters excluded), on one cp rank at CP 2 and 4, against the single process at
CP 1 on the same sequence (s = 64, b = 2, both families, dropout off): at least 0.95 x CP1 / CP,
at most CP1 / CP plus the documented extra (README, "Context parallel"):

- ``p2p``, ``a2a``: two ``[b, s/cp, h]`` tensors per layer (measured: the attention output kept in
  the kernel's layout besides the projection's input, and the fused QKV storage that V is a view
  of, where the single process's SDPA saves its own expanded copies);
- ``all_gather``: that, plus the whole sequence's K/V per layer (``2 x b x s x g x d``).
"""

from __future__ import annotations

import torch

from megalite.core.context_parallel import cp_token_indices, split_for_cp
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_config

S = 64


def saved_activation_bytes(model: GPTModel, tokens, positions, labels) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in ``model``'s forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, positions, labels=labels)
    assert loss.requires_grad
    return sum(seen.values())


def _bytes(family: str, ps: ParallelState, comm_type: str) -> int:
    cfg = make_config(family, seq_length=S, cp_comm_type=comm_type)
    model = GPTModel(cfg, ps)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, S), generator=g)
    cp, r = ps.cp_size, ps.cp_rank
    positions = cp_token_indices(S, cp, r).unsqueeze(0)
    return saved_activation_bytes(
        model, split_for_cp(tokens, 1, cp, r), positions, split_for_cp(labels, 1, cp, r)
    )


def _case() -> dict:
    out = {}
    for cp in (2, 4):
        ps = mesh(1, 1, cp=cp)
        for family in ("gpt2", "llama"):
            for comm_type in ("p2p", "a2a", "all_gather"):
                out[(cp, family, comm_type)] = _bytes(family, ps, comm_type)
        ps.destroy()
    return out


def _extra_bytes(family: str, cp: int, comm_type: str) -> int:
    cfg = make_config(family)
    hidden = 2 * cfg.num_layers * 2 * (S // cp) * cfg.hidden_size * 4  # two [b, s/cp, h] fp32
    if comm_type != "all_gather":
        return hidden
    groups = cfg.num_query_groups or cfg.num_attention_heads
    kv = 2 * 2 * S * groups * cfg.kv_channels * 4  # k and v, b = 2, fp32, one layer
    return hidden + cfg.num_layers * kv


def test_saved_activations_scale_as_one_over_cp():
    single = {f: _bytes(f, ParallelState.single(), "p2p") for f in ("gpt2", "llama")}
    results = run_distributed(_case, 4)
    for rank_result in results:
        for (cp, family, comm_type), got in rank_result.items():
            share = single[family] / cp
            what = f"{family} CP{cp} {comm_type}: {got} bytes vs CP1 {single[family]} / {cp}"
            assert 0.95 * share <= got <= share + _extra_bytes(family, cp, comm_type), what
