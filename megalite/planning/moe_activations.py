"""Activation bytes of a MoE MLP on one rank, and the routing assumption they rest on.

How many (token, expert) rows reach a rank's experts is the router's choice at run time, so the
planner states what it assumes (``Routing``):

- **balanced** (the default): every expert gets ``topk / E`` of the tokens, what load balancing
  aims for;
- **shares**: a given fraction of the tokens chooses each expert (``E`` entries summing to
  ``topk``, each at most 1), e.g. the routing a first step measured;
- **worst**: the most any routing the capacity settings allow puts on one rank. Dropless, every
  token sends ``min(topk, E_local)`` of its choices to the rank's experts (all tokens to the fewest
  experts top-k allows); with a capacity factor each expert keeps at most ``capacity`` of each
  source rank's tokens; padded to capacity, the experts' rows do not depend on the routing at all.

Every source rank is assumed to route its tokens with the same shares. Per MoE layer and
micro-batch, with ``T`` the tokens entering the layer on this rank, ``P`` the (token, expert)
pairs it keeps (its own, after capacity), ``R`` the rows its local experts compute (from every
rank of its etp x ep group), ``e`` the activation dtype's bytes and ``f`` the expert ffn per ETP
rank, autograd keeps::

    router      x in fp32 [T, h] 4 (a copy unless e = 4) and the weight's fp32 copy [E, h] 4
                (unless e = 4); scores [T, E] 4, the top-k indices [T, k] 8 and probs [T, k] 4
    dispatch    the routing map [T, E] bool (all-gather: the gathered [group T, E]); with a
                capacity factor the map of kept choices again
    all-to-all  per pair: its token index [2] int64 (+ its padded slot int64 when padded);
                per row: the sort permutation and its inverse [R] int64, the row [R, h] e
    all-gather  per row: its token index [2] int64 and the row [R, h] e (pairs are the rows)
    experts     per row: fc1 output and the activation's output (SwiGLU: fc1 [2f], silu(gate)
                [f], the product [f]): (2 or 4) f e
    combine     per pair: the expert output and its product with the weight [P, h] e each, the
                weight [P] e

(Shared experts are a dense MLP beside these: ``activations.layer_bytes`` counts them.)
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.moe.router import expert_capacity
from megalite.models.config import GPTConfig


@dataclass(frozen=True)
class MoEShape:
    """How a MoE layer's tokens meet its experts on one rank: ``group`` ranks' tokens gathered
    (the all-gather dispatcher's etp x ep; 1 for all-to-all), ``ep`` / ``etp`` sizes, and this
    rank's ``ep_rank`` (its experts: ``E / ep`` consecutive ones)."""

    ep: int = 1
    etp: int = 1
    group: int = 1
    ep_rank: int = 0


@dataclass(frozen=True)
class Routing:
    """The planner's routing assumption for every MoE layer (module docstring): ``shares``
    None is balanced; ``worst`` is the bound for any routing the capacity settings allow."""

    shares: tuple[float, ...] | None = None
    worst: bool = False

    def describe(self, c: GPTConfig) -> str:
        """The assumption in words, for a log line."""
        if self.worst and c.moe_expert_capacity_factor is None:
            return "any routing (dropless: all tokens to the fewest experts top-k allows)"
        if self.worst:
            padded = (
                c.moe_token_dispatcher_type == "alltoall" and c.moe_pad_expert_input_to_capacity
            )
            return f"any routing (each expert full to capacity{', padded' if padded else ''})"
        if self.shares is None:
            k, e = c.moe_router_topk, c.num_experts
            return f"balanced routing (each expert {k}/{e} of the tokens)"
        return f"this routing (busiest expert {max(self.shares):.0%} of the tokens)"


BALANCED = Routing()
WORST = Routing(worst=True)


def routed_rows(c: GPTConfig, m: MoEShape, tokens: int, routing: Routing) -> tuple[float, float]:
    """(P, R): the (token, expert) pairs this rank keeps of its ``tokens`` tokens, and the rows
    its local experts compute, under ``routing`` (module docstring)."""
    k, E = c.moe_router_topk, c.num_experts
    el = E // m.ep
    cf = c.moe_expert_capacity_factor
    cap = None if cf is None else expert_capacity(tokens, E, k, cf)
    sources = m.etp * m.ep  # ranks whose tokens reach this rank's experts
    if routing.worst:
        per_expert = tokens if cap is None else min(tokens, cap)
        local = min(tokens * k, el * per_expert)  # each expert at most once per token
        pairs = min(tokens * k, E * per_expert)
    else:
        shares = routing.shares if routing.shares is not None else (k / E,) * E
        if len(shares) != E:
            raise ValueError(f"routing shares has {len(shares)} entries, need num_experts {E}")
        kept = [tokens * s if cap is None else min(tokens * s, cap) for s in shares]
        local = sum(kept[m.ep_rank * el : (m.ep_rank + 1) * el])
        pairs = sum(kept)
    if c.moe_token_dispatcher_type == "alltoall" and c.moe_pad_expert_input_to_capacity:
        return pairs, sources * el * cap  # every source sends each local expert `cap` rows
    return pairs, sources * local


def moe_mlp_bytes(
    c: GPTConfig,
    m: MoEShape,
    *,
    tokens: int,
    e: int,
    routing: Routing = BALANCED,
) -> int:
    """Saved bytes of a MoE layer's router, dispatch and experts (module docstring) for
    ``tokens`` tokens entering it on this rank."""
    h, k, E = c.hidden_size, c.moe_router_topk, c.num_experts
    f = (c.moe_ffn_hidden_size or c.ffn_hidden_size) // m.etp
    pairs, rows = routed_rows(c, m, tokens, routing)
    alltoall = c.moe_token_dispatcher_type == "alltoall"
    out = 0 if e == 4 else tokens * h * 4 + E * h * 4  # the router's fp32 copies
    out += tokens * E * 4 + tokens * k * 12  # scores, top-k indices and probabilities
    out += tokens * E * (1 if alltoall else m.group)  # the routing map
    if c.moe_expert_capacity_factor is not None:
        out += tokens * E  # the map of kept choices
    if alltoall:
        out += pairs * (24 if c.moe_pad_expert_input_to_capacity else 16)
    else:
        pairs = rows  # the all-gather dispatcher combines the rows it computed
    out += rows * (16 + h * e)  # indices and the rows themselves
    out += rows * (4 if c.swiglu else 2) * f * e  # the experts
    out += pairs * (2 * h * e + e)  # the combine
    return round(out)
