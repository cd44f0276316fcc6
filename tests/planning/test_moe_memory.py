"""The planner's MoE activations follow the routing, on a MoE shape no other test uses.

4 experts, top-2, hidden 96, 6 heads, sequence 48, micro-batch 3, on 4 ranks at EP 1, 2 and 4
(expert data-parallel 4, 2, 1), both dispatchers. The routers are forced (test only: a forward
hook on each ``TopKRouter`` replaces its choice by a fixed one, ``force_routing``) to send each
expert an exact share of every rank's tokens: balanced (each expert 1/2), skewed (70% of the
tokens to expert 0, the rest spread evenly) and the worst a dropless routing allows (every token
to experts 0 and 1). The saved-activation peak of one training step (saved-tensor hooks) must be
within 5% of the planner's prediction for that routing on every rank, below its bound for any
routing, and equal to the bound (5%) on the ranks that hold experts 0 and 1 under the worst one.
The first-step comparison says which figure applies.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist

from megalite.core.moe.router import routers_of
from megalite.measure.first_step import FirstStepComparison, which_figure_applies
from megalite.measure.saved_tensors import measure_step
from megalite.planning.moe_activations import BALANCED, WORST, MoEShape, Routing, routed_rows
from megalite.planning.predict import predict_for_config
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import build_run, mesh_for
from tests.harness import run_distributed
from tests.training.common import LogCapture, config

ACT_REL = 0.05  # the planner's bar for activations
SHAPE = (
    "--num-experts 4 --moe-router-topk 2 --hidden-size 96 --num-attention-heads 6 "
    "--seq-length 48 --max-position-embeddings 48 --micro-batch-size 3 --global-batch-size 12"
).split()
DISPATCHERS = ("allgather", "alltoall")
EPS = (1, 2, 4)
ROUTINGS = {
    "balanced": (0.5, 0.5, 0.5, 0.5),
    "skewed": (0.7, 1.3 / 3, 1.3 / 3, 1.3 / 3),
    "worst": (1.0, 1.0, 0.0, 0.0),
}


def forced_map(shares: tuple[float, ...], tokens: int, topk: int) -> torch.Tensor:
    """A routing map # [tokens, E] bool: every token chooses ``topk`` distinct experts, expert j
    gets ``shares[j] * tokens`` of them (rounded so that the counts add up to ``tokens * topk``).
    Experts take consecutive runs of a cyclic walk over the tokens; no run is longer than
    ``tokens``, so no token meets an expert twice."""
    ends = [round(tokens * sum(shares[: j + 1])) for j in range(len(shares))]
    counts = [min(tokens, end - start) for start, end in zip([0, *ends], ends)]
    assert sum(counts) == tokens * topk, (shares, counts)
    routing = torch.zeros(tokens, len(shares), dtype=torch.bool)
    position = 0
    for expert, n in enumerate(counts):
        routing[torch.arange(position, position + n) % tokens, expert] = True
        position += n
    return routing


def force_routing(model: list, shares: tuple[float, ...]) -> None:
    """Every router of ``model`` (chunks) routes its tokens by ``forced_map``: its output is
    replaced by the forced map and the probabilities spread evenly over it (kept in the graph,
    so the aux losses still reach the router); its per-expert counts follow."""

    def hook(router, args, output):
        probs, routing = output
        forced = forced_map(shares, routing.shape[0], router.config.router_topk).to(probs.device)
        if router.training and torch.is_grad_enabled():  # the counts the step logs
            router.stats[3:] += forced.sum(0) - routing.sum(0)
        return probs.sum(-1, keepdim=True) / router.config.router_topk * forced, forced

    for router in routers_of([chunk.module for chunk in model]):
        router.register_forward_hook(hook)


def _cases(dispatcher: str, eps: tuple[int, ...], routings: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for ep in eps:
        flags = (*SHAPE, "--moe-token-dispatcher-type", dispatcher)
        cfg = config(*flags, "--expert-model-parallel-size", str(ep), world_size=world, rank=rank)
        for name, shares in routings.items():
            ps = mesh_for(cfg.parallel)
            try:
                run = build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False)
                force_routing(run.trainer.model, shares)
                forward_step = make_forward_step(torch.device("cpu"))
                _, act, _ = measure_step(run.trainer, forward_step, run.train_iter)
                kw = dict(dp=ps.dp_size, dp_ranks=[ps.rank("dp", "cp")], device="cpu")
                kw.update(edp_rank=ps.rank("edp"), ep_rank=ps.rank("ep"))
                balanced = predict_for_config(cfg, **kw, routing=BALANCED)[0].activations
                routed = predict_for_config(cfg, **kw, routing=Routing(shares))[0].activations
                out[ep, name] = (ps.rank("ep"), act, balanced.peak, routed.peak, balanced.bound)
            finally:
                ps.destroy()
    return out


def _check_all(dispatcher: str) -> list[str]:
    results = run_distributed(_cases, 4, dispatcher, EPS, ROUTINGS, timeout=600)
    lines = []
    for rank, per_rank in enumerate(results):
        for (ep, name), (ep_rank, act, balanced, routed, bound) in per_rank.items():
            what = f"{dispatcher} EP{ep} {name} rank {rank} (ep rank {ep_rank})"
            lines.append(
                f"{what}: measured {act}, predicted {routed} ({routed / act - 1:+.1%}), "
                f"balanced {balanced}, bound {bound}"
            )
            assert abs(routed - act) <= ACT_REL * act, lines[-1]
            if name == "balanced":
                assert balanced == routed, lines[-1]  # the default assumption is this routing
            assert act <= bound * (1 + ACT_REL), lines[-1]
            holds_first_two = ep_rank * 4 // ep < 2  # its experts include expert 0 or 1
            if name == "worst" and holds_first_two:
                assert abs(bound - act) <= ACT_REL * act, lines[-1]
    return lines


def test_allgather_moe_activations_follow_the_routing_at_ep_1_2_4():
    _check_all("allgather")


def test_alltoall_moe_activations_follow_the_routing_at_ep_1_2_4():
    _check_all("alltoall")


def test_forced_maps_give_every_token_topk_distinct_experts():
    for shares in ROUTINGS.values():
        routing = forced_map(shares, 144, 2)
        assert routing.sum(1).tolist() == [2] * 144
        for expert, share in enumerate(shares):
            assert abs(routing[:, expert].sum().item() - share * 144) <= 1, (shares, expert)


def _first_step_line(shares: tuple[float, ...]) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = (*SHAPE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")
    cfg = config(*flags, world_size=world, rank=rank)
    ps = mesh_for(cfg.parallel)
    try:
        run = build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False)
        force_routing(run.trainer.model, shares)
        run.trainer.first_step_hooks.append(FirstStepComparison())
        logging.getLogger("megalite").propagate = False
        with LogCapture() as log:
            run.trainer.step(make_forward_step(torch.device("cpu")), run.train_iter)
        return next(line for line in log.lines if line.startswith("planner vs first step"))
    finally:
        ps.destroy()


def test_first_step_comparison_says_which_figure_applies():
    """At EP 2: balanced, the balanced figure applies on every rank; skewed, this step's own on
    the ranks holding expert 0 (EP rank 0: ranks 0 and 2), which predict more than balanced;
    worst, the bound on those ranks (they hold experts 0 and 1, which take every token). Every
    time the measurement is within 5% of this step's figure and the line gives the bound."""
    for name, verdict in (
        ("balanced", "the balanced figure applies"),
        ("skewed", "routing skewed (+"),
        ("worst", "the bound applies"),
    ):
        lines = run_distributed(_first_step_line, 4, ROUTINGS[name], timeout=600)
        for rank, line in enumerate(lines):
            assert "at most" in line and "for any routing (dropless" in line, line
            measured = float(re.search(r"\(saved tensors, ([+-][\d.]+)%\)", line).group(1))
            assert abs(measured) <= 100 * ACT_REL, line
            if name == "balanced" or rank in (0, 2):
                assert line.endswith(verdict) or f"; {verdict}" in line, (rank, line)
            if name == "skewed" and rank in (0, 2):
                assert "busiest expert 70% of the tokens" in line, line


def test_which_figure_applies_within_5_percent_of_balanced_or_the_bound():
    assert which_figure_applies(100, 104, 200) == "the balanced figure applies"
    assert which_figure_applies(100, 196, 200).startswith("the bound applies")
    assert which_figure_applies(100, 130, 200) == (
        "routing skewed (+30.0%): this step's figure applies"
    )
    assert which_figure_applies(100, 100, 100) == "the balanced figure applies"  # padded


def _random_shares(g: torch.Generator, experts: int, topk: int) -> tuple[float, ...]:
    """Shares a router could produce: ``topk`` distinct experts per token, each at most 1."""
    tokens = 1000
    choice = torch.rand(tokens, experts, generator=g) ** 4  # uneven, different every draw
    picked = torch.zeros(tokens, experts).scatter_(1, choice.topk(topk, dim=1).indices, 1.0)
    return tuple((picked.double().sum(0) / tokens).tolist())


def test_the_bound_holds_for_any_routing_the_capacity_settings_allow():
    """Pure arithmetic: the worst routing's (pairs, rows) bound every routing's, dropless, with a
    capacity factor and padded to it, at EP 1, 2, 4; with capacity 1 the experts' rows are at most
    the balanced ones, padded they are the same whatever the routing."""
    tokens = 144
    capacity = ("--moe-expert-capacity-factor", "1.0")
    padded = (*capacity, "--moe-token-dispatcher-type", "alltoall")
    settings = {
        "dropless": (),
        "capacity": capacity,
        "padded": (*padded, "--moe-pad-expert-input-to-capacity"),
    }
    g = torch.Generator().manual_seed(0)
    draws = [_random_shares(g, 4, 2) for _ in range(20)] + list(ROUTINGS.values())
    for name, flags in settings.items():
        c = config(*SHAPE, *flags).model
        for ep in EPS:
            for ep_rank in range(ep):
                m = MoEShape(ep=ep, group=ep, ep_rank=ep_rank)
                worst_pairs, worst_rows = routed_rows(c, m, tokens, WORST)
                _, balanced_rows = routed_rows(c, m, tokens, BALANCED)
                for shares in draws:
                    pairs, rows = routed_rows(c, m, tokens, Routing(shares))
                    what = (name, ep, ep_rank, shares)
                    assert pairs <= worst_pairs * (1 + 1e-9) and rows <= worst_rows * (1 + 1e-9), (
                        what
                    )
                    if name == "padded":
                        assert rows == balanced_rows, what
                if name == "dropless":  # all tokens to the rank's experts, min(topk, E_local) each
                    assert worst_rows == ep * tokens * min(2, 4 // ep)
                else:  # capacity 1: each expert full at its balanced share
                    assert worst_rows == balanced_rows == ep * (4 // ep) * 72
