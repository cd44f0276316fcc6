"""Expert parameters (``expert_parallel = True``) are reduced and sharded over the expert DP group.

World 4, EP 2 (``mesh(ep=2)``): dense DP 4, expert DP
2. ``ExpertTiny`` has dense parameters (an embedding, two linears) and one local expert (a linear
tagged ``expert_parallel``): rank ``r`` holds expert ``ep_rank(r)`` and trains on chunk ``r`` of
the global batch. The oracle, in one process, holds both experts and minimises the mean over the 4
ranks of each rank's loss (rank ``r``'s loss through expert ``ep_rank(r)``), with
``clip_grad_norm_`` over every parameter once and ``torch.optim.AdamW``. So the dense grads are
the DP-4 mean, an expert's grad is the sum over its 2 edp peers divided by the dense DP size 4 (the
all-to-all convention), and the clipped norm counts dense and expert squares once each. Every rung
(DDP, ZeRO-1 ``optim``, ZeRO-2, ZeRO-3) runs 3 clipped steps: params 1e-6 relative, norms 1e-6.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.core.optimizer import get_param_groups
from megalite.training.components import wrap_and_build_optimizer
from tests.core import zero_cases as zc
from tests.harness import run_distributed
from tests.mesh import mesh

VOCAB, H, ROWS, SEQ = 11, 8, 8, 4
LR, WD, CLIP = 1e-2, 0.1, 0.05  # clip below every step's norm: the clip coefficient matters


class ExpertTiny(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.fc_in = nn.Linear(H, H)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(num_experts))
        self.fc_out = nn.Linear(H, VOCAB)
        for e in self.experts:
            for p in e.parameters():
                p.expert_parallel = True
        self.active = 0  # which expert the forward uses

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc_in(self.emb(tokens)))
        return self.fc_out(torch.tanh(self.experts[self.active](h)))


def oracle_model() -> ExpertTiny:
    torch.manual_seed(0)
    return ExpertTiny(2)


def local_model(ep_rank: int) -> ExpertTiny:
    """This rank's model: the oracle's dense params and expert ``ep_rank``."""
    full, local = oracle_model(), ExpertTiny(1)
    with torch.no_grad():
        for name, p in local.named_parameters():
            src = name.replace("experts.0", f"experts.{ep_rank}")
            p.copy_(full.get_parameter(src))
    return local


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return tokens, (tokens * 5 + 2) % VOCAB


def loss_of(model, tokens, targets) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def oracle(steps: int, ep_of_rank: list[int]) -> tuple[list[torch.Tensor], list[float]]:
    model = oracle_model()
    opt = torch.optim.AdamW(get_param_groups(model, weight_decay=WD), lr=LR, weight_decay=WD)
    norms, world = [], len(ep_of_rank)
    for step in range(steps):
        opt.zero_grad()
        tokens, targets = batch(step)
        loss = 0.0
        for r, (t, y) in enumerate(zip(tokens.chunk(world), targets.chunk(world))):
            model.active = ep_of_rank[r]
            loss = loss + loss_of(model, t, y) / world
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def build(rung: str, ps):
    model, opt = wrap_and_build_optimizer(
        local_model(ps.rank("ep")),
        ps,
        strategy=rung,
        bucket_size=40,
        lr=LR,
        weight_decay=WD,
        clip_grad=CLIP,
    )
    return model, opt


def expert_case(rungs: list[str], steps: int) -> dict:
    ps = mesh(1, 1, ep=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_of_rank = [None] * world
    dist.all_gather_object(ep_of_rank, ps.rank("ep"))
    want, want_norms = oracle(steps, ep_of_rank)
    out = {}
    for rung in rungs:
        model, opt = build(rung, ps)
        norms = []
        for step in range(steps):
            model.zero_grad_buffer()
            opt.zero_grad()
            tokens, targets = batch(step)
            loss_of(model, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
            model.finish_grad_sync()
            _, norm, _ = opt.step()
            norms.append(float(norm))
        errs = []
        with model.gathered_params():
            for name, p in model.module.named_parameters():
                src = name.replace("experts.0", f"experts.{ps.rank('ep')}")
                errs.append(zc.rel_err(p.detach(), want[src]))
        out[rung] = (max(errs), [abs(a - b) / b for a, b in zip(norms, want_norms)])
    return out


def test_expert_params_reduce_and_shard_over_expert_dp():
    rungs = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
    for rank_out in run_distributed(expert_case, 4, rungs, 3):
        for rung, (param_err, norm_errs) in rank_out.items():
            assert param_err < 1e-6, (rung, param_err)
            assert max(norm_errs) < 1e-6, (rung, norm_errs)
