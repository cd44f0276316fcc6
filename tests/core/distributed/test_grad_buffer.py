"""The contiguous grad buffer and the data-parallel wrapper's grad sync.

- layout: buckets in reverse registration order, closed once ``bucket_size`` is reached, padded to
  ``pad_multiple``; ``main_grad`` views alias the buffer (checked by writing through them);
- accumulation: micro-batch grads of bf16 parameters summed in an fp32 buffer equal the float64 sum
  of the per-micro-batch grads (to fp32 rounding), ``param.grad`` is freed; a bf16 buffer without
  ``--accumulate-allreduce-grads-in-fp32``;
- sync on 2 ranks: the DP average, the TP sum of sequence-parallel grads, and the embedding-group
  sum of tied-embedding grads, each against values computed locally from both ranks' inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.distributed.grad_buffer import GradBuffer
from tests.harness import run_distributed


def test_bucket_layout_reverse_order_padding_and_views():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 5)]
    buf = GradBuffer(params, grad_dtype=torch.float32, bucket_size=25, pad_multiple=4)
    # reversed: 5, 30 -> 35 >= 25 closes bucket 0 (padded to 36); 20, 10 -> bucket 1 (32)
    assert [[p.numel() for p in b.params] for b in buf.buckets] == [[5, 30], [20, 10]]
    assert [b.data.numel() for b in buf.buckets] == [36, 32] and buf.numel == 68
    assert [b.offset for b in buf.buckets] == [0, 36]
    assert buf.param_ranges[params[3]] == (0, 5, 0)
    assert buf.param_ranges[params[2]] == (5, 35, 0)
    assert buf.param_ranges[params[1]] == (36, 56, 1)
    for i, p in enumerate(params):
        p.main_grad.fill_(i + 1)
    assert buf.data[35].item() == 0 and buf.data[66:].eq(0).all()  # padding untouched
    assert buf.buckets[1].data[:20].eq(2).all() and buf.buckets[1].data[20:30].eq(1).all()
    single = GradBuffer(params, grad_dtype=torch.float32, bucket_size=None)
    assert len(single.buckets) == 1 and single.numel == 65


def _microbatch_grads(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-micro-batch grads without touching .grad (autograd.grad fires no accumulate hooks)."""
    params = list(model.parameters())
    return [torch.autograd.grad(model(x).float().square().sum(), params) for x in xs]


def test_fp32_accumulation_of_bf16_grads_and_grad_freed():
    torch.manual_seed(0)
    for fp32 in (True, False):
        module = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).to(torch.bfloat16)
        model = DistributedDataParallel(
            module, dp_group=None, accumulate_allreduce_grads_in_fp32=fp32, bucket_size=100
        )
        xs = [torch.randn(3, 16, dtype=torch.bfloat16) for _ in range(4)]
        reference = [
            torch.stack([g[i].double() for g in _microbatch_grads(module, xs)]).sum(0)
            for i in range(4)
        ]
        model.zero_grad_buffer()
        for x in xs:
            model(x).float().square().sum().backward()
        model.finish_grad_sync()  # a DP group of one: nothing to reduce
        for p, ref in zip(module.parameters(), reference):
            assert p.grad is None
            assert p.main_grad.dtype == (torch.float32 if fp32 else torch.bfloat16)
            rel = ((p.main_grad.double() - ref).abs().max() / ref.abs().max()).item()
            # fp32 sums of 4 bf16 grads: ~1e-7; bf16 sums lose ~1e-3
            assert rel < (1e-6 if fp32 else 2e-2), (fp32, rel)


def _sync_case() -> dict:
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)  # plain: averaged over DP
    norm = nn.Parameter(torch.ones(3))
    norm.sequence_parallel = True  # summed over TP
    emb = nn.Parameter(torch.ones(5, 3))  # tied embedding: summed over the embedding group
    module = nn.Module()
    module.lin, module.norm, module.emb = lin, norm, emb

    def loss(r: int) -> torch.Tensor:
        x = torch.arange(8.0).reshape(2, 4) * (r + 1)
        return (lin(x) * norm).sum() + (emb * (r + 1)).square().sum()

    per_rank = []
    for r in (0, 1):  # the reference: each rank's grads, computed here without communication
        per_rank.append(torch.autograd.grad(loss(r), [lin.weight, lin.bias, norm, emb]))

    results = {}
    for role in ("dp", "tp", "embedding"):
        groups = {"dp_group": None, "tp_group": None, "embedding_group": None}
        groups[f"{role}_group"] = group
        shared = [emb] if role == "embedding" else []
        model = DistributedDataParallel(module, shared_params=shared, bucket_size=7, **groups)
        model.zero_grad_buffer()
        loss(rank).backward()
        model.finish_grad_sync()
        results[role] = [p.main_grad.clone() for p in (lin.weight, lin.bias, norm, emb)]
        for h in model._hooks:
            h.remove()
    return {"results": results, "per_rank": per_rank}


def test_dp_average_sp_sum_and_embedding_sum_on_two_ranks():
    for rank, out in enumerate(run_distributed(_sync_case, 2)):
        mine, other = out["per_rank"][rank], out["per_rank"][1 - rank]
        mean = [(a + b) / 2 for a, b in zip(mine, other)]
        total = [a + b for a, b in zip(mine, other)]
        dp, tp, emb = out["results"]["dp"], out["results"]["tp"], out["results"]["embedding"]
        for got, want in zip(dp, mean):  # every grad averaged over DP
            torch.testing.assert_close(got, want)
        # TP: only the sequence-parallel norm is summed; the rest stay this rank's own
        for got, want in zip(tp, [mine[0], mine[1], total[2], mine[3]]):
            torch.testing.assert_close(got, want)
        for got, want in zip(emb, [mine[0], mine[1], mine[2], total[3]]):
            torch.testing.assert_close(got, want)
