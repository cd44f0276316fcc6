"""Token dispatchers: move each token to the ranks holding its experts and the results back.

Both take this rank's tokens ``x`` # [T, h], the router's ``probs`` # [T, E] fp32 and
``routing_map`` # [T, E] bool, run ``experts`` on the tokens of this EP rank's local experts, and
return # [T, h]: the sum over each token's experts of ``prob * expert(token)``.

**all-to-all** (``token_dispatcher_type="alltoall"``, dropless by default):
1. permute: copy each routed token once per chosen expert, grouped by global expert;
2. exchange the per-expert counts over the EP group (one small all-to-all; the split sizes must be
   known on the host), then the tokens (all-to-all over EP: rank j gets the tokens of its experts);
3. expert-TP: all-gather them over the ETP group (uneven), sort by local expert, run the experts
   (each ETP rank a slice of the ffn dim), reduce-scatter the partial outputs back (uneven);
4. the reverse all-to-all; unpermute: weight by the probabilities and sum per token.
With ``pad_expert_input_to_capacity`` every expert gets exactly ``capacity`` rows from each
rank (zeros where it has fewer), so the sizes are known without exchanging counts.

**allgather** (``token_dispatcher_type="allgather"``): all-gather tokens, probabilities and
routing over the ETP x EP group (equal sizes), run the local experts on the tokens routed to them,
scatter-add the weighted outputs, reduce-scatter over the same group (which also sums the ETP
partials). Simpler; moves every token to every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.groups import group_rank, group_size
from megalite.core.moe.comm import (
    all_gather_counts,
    all_to_all,
    all_to_all_counts,
    gather_v,
    reduce_scatter_v,
)
from megalite.core.moe.router import expert_capacity
from megalite.core.tensor_parallel.mappings import (
    gather_from_sp_region,
    reduce_scatter_to_sp_region,
)


def _chunk_permutation(sizes: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Rows lie in chunks laid out row-major over ``sizes`` (an int tensor of any rank); the row
    index order that lays the same chunks out row-major over ``sizes.permute(dims)``."""
    flat = sizes.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(sizes).permute(dims).reshape(-1)
    new_sizes = sizes.permute(dims).reshape(-1)
    new_starts = new_sizes.cumsum(0) - new_sizes
    total = int(flat.sum())
    within = torch.arange(total) - torch.repeat_interleave(new_starts, new_sizes)
    return torch.repeat_interleave(starts, new_sizes) + within


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _permute(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """(token index # [N], weight # [N], counts per expert # [E]): routed (token, expert) pairs,
    grouped by expert, tokens ascending within each."""
    expert_major = routing_map.t()  # [E, T]
    _, token = expert_major.nonzero(as_tuple=True)
    weight = probs.t()[expert_major]  # [N] fp32, same order
    return token, weight, routing_map.sum(0)


def _unpermute(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, num_tokens: int):
    out = y.new_zeros(num_tokens, y.shape[1])
    return out.index_add(0, token, y * weight.unsqueeze(1).to(y.dtype))


class AllToAllDispatcher(nn.Module):
    def __init__(
        self,
        *,
        num_experts: int,
        ep_group,
        etp_group,
        capacity_factor=None,
        topk: int = 1,
        pad_to_capacity: bool = False,
    ):
        super().__init__()
        self.num_experts, self.ep_group, self.etp_group = num_experts, ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.num_local_experts = num_experts // self.ep
        self.capacity_factor, self.topk = capacity_factor, topk
        self.pad_to_capacity = pad_to_capacity

    def forward(self, x, probs, routing_map, experts) -> torch.Tensor:
        num_tokens, e, el = x.shape[0], self.num_experts, self.num_local_experts
        token, weight, counts = _permute(x, probs, routing_map)
        permuted = x[token]  # [N, h]
        if self.pad_to_capacity:  # every expert exactly `cap` rows: sizes known, no count exchange
            cap = expert_capacity(num_tokens, e, self.topk, self.capacity_factor)
            starts = counts.cumsum(0) - counts
            expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts)
            slot = expert * cap + torch.arange(token.numel(), device=x.device) - starts[expert]
            permuted = x.new_zeros(e * cap, x.shape[1]).index_copy(0, slot, permuted)
            send = torch.full((self.ep, el), cap, dtype=torch.long)
            recv_etp = torch.full((self.etp, self.ep, el), cap, dtype=torch.long)
        else:
            send_dev = counts.view(self.ep, el)
            recv_dev = all_to_all_counts(send_dev, self.ep_group)  # [ep, el]: from each rank
            recv_all = all_gather_counts(recv_dev.reshape(-1), self.etp_group)  # [etp, ep * el]
            both = torch.cat([send_dev.reshape(-1), recv_all.reshape(-1)]).cpu()  # one host read
            send = both[:e].view(self.ep, el)
            recv_etp = both[e:].view(self.etp, self.ep, el)
        recv = recv_etp[group_rank(self.etp_group)]  # [ep, el]
        # tokens to the ranks of their experts: [src ep rank][local expert]
        received = all_to_all(permuted, self.ep_group, recv.sum(1).tolist(), send.sum(1).tolist())
        per_etp = recv_etp.sum((1, 2)).tolist()
        gathered = gather_v(received, self.etp_group, per_etp)  # [etp rank][src][local expert]
        perm = _chunk_permutation(recv_etp, (2, 0, 1)).to(x.device)  # -> [expert][etp][src]
        y = experts(gathered[perm], recv_etp.sum((0, 1)).tolist())
        y = reduce_scatter_v(y[_inverse(perm).to(x.device)], self.etp_group, per_etp)
        y = all_to_all(y, self.ep_group, send.sum(1).tolist(), recv.sum(1).tolist())
        if self.pad_to_capacity:
            y = y[slot]
        return _unpermute(y, token, weight, num_tokens)


class AllGatherDispatcher(nn.Module):
    def __init__(self, *, num_experts: int, ep_rank: int, ep_size: int, expert_group):
        super().__init__()
        self.num_experts, self.expert_group = num_experts, expert_group
        el = num_experts // ep_size
        self.local = (ep_rank * el, (ep_rank + 1) * el)

    def forward(self, x, probs, routing_map, experts) -> torch.Tensor:
        g = self.expert_group
        x_all = gather_from_sp_region(x, g)  # [n * T, h]; backward: reduce-scatter
        probs_all = gather_from_sp_region(probs, g)  # [n * T, E]
        with torch.no_grad():
            map_all = gather_from_sp_region(routing_map.to(probs.dtype), g) > 0.5
        lo, hi = self.local
        token, weight, counts = _permute(x_all, probs_all[:, lo:hi], map_all[:, lo:hi])
        y = experts(x_all[token], counts.tolist())
        out_all = _unpermute(y, token, weight, x_all.shape[0])
        return reduce_scatter_to_sp_region(out_all, g)  # [T, h], summed over ETP x EP
