"""The norm of the data-parallel mean of gradients that were never averaged: what clipping needs in
the compressed optimizers' steps, where each rank's gradient stays local.

Adam clips the DP-averaged gradient ``gbar = mean_r g_r`` by ``min(1, clip / |gbar|)``. In a
compressed step no rank holds ``gbar``, and a rank's own norm is larger: with gradient noise of
variance ``sigma^2`` per rank, ``|g_r|^2 ~ |mu|^2 + sigma^2`` against ``|gbar|^2 ~ |mu|^2 +
sigma^2 / n`` over ``n`` ranks. Clipping each rank by its own norm therefore scales the steps down
by a factor that grows with the noise, and differently on every rank.

The estimate: a count sketch (Charikar, Chen and Farach-Colton, 2002) of ``size`` buckets.
Coordinate ``j`` of the counted grads (concatenated in order) adds ``s_j g_j`` to bucket
``j mod size``, with random signs ``s_j = +-1`` drawn from ``seed`` alone, so every DP rank uses
the same signs. The sketch is linear: the DP mean of the ranks' sketches (one fp32 all-reduce of
``size + 1`` values) is the sketch of ``gbar``. The squared norm of a sketch estimates its
vector's squared norm without bias (the signs' cross terms average to zero), with a relative
standard deviation near ``sqrt(2 / size)`` when no few coordinates hold most of the mass (4.4%
for 1,024 buckets, 2.2% on the norm). With at most ``size`` counted values every coordinate has
a bucket of its own and the estimate is exact. The extra value is the rank's own squared norm, so
the mean of those comes along.

Both results are summed over ``groups`` (the model-parallel group: each rank sketches its own
shard, and the squared norms of the shards add). No host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megalite.core.groups import group_size
from megalite.core.optimizer.grad_norm import all_reduce_over

SKETCH_SIZE = 1024  # buckets: 4 KiB more on the DP wire per step; ~2% noise on the norm


def sketch_size(numel: int, size: int = SKETCH_SIZE) -> int:
    """Buckets for ``numel`` counted values: ``size``, or fewer when each value can have its own."""
    return max(1, min(size, numel))


def _fold(sketch: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """``sketch[(start + i) % len(sketch)] += values[i]`` for every ``i`` (1-d ``values``)."""
    k = sketch.numel()
    first = start % k
    head = min(k - first, values.numel())
    sketch[first : first + head] += values[:head]
    rest = values[head:]
    whole = rest.numel() // k * k
    if whole:
        sketch += rest[:whole].view(-1, k).sum(0)
    tail = rest[whole:]
    sketch[: tail.numel()] += tail


def sketched_mean_sq_norm(
    grads: list[torch.Tensor],
    *,
    dp_group,
    groups: Sequence = (),
    seed: int,
    device: torch.device,
    size: int = SKETCH_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the estimate of ``|mean over dp_group of g|^2``, ``mean over dp_group of |g_r|^2``), fp32
    0-d tensors, each summed over ``groups``; ``grads`` are this rank's counted grads (the same
    shapes on every rank of ``dp_group``). See the module docstring."""
    k = sketch_size(sum(g.numel() for g in grads), size)
    sketch = torch.zeros(k + 1, dtype=torch.float32, device=device)  # [buckets, own |g|^2]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    start = 0
    for g in grads:
        flat = g.detach().reshape(-1).to(device=device, dtype=torch.float32)
        signs = torch.empty_like(flat).bernoulli_(0.5, generator=gen).mul_(2).sub_(1)
        _fold(sketch[:k], signs.mul_(flat), start)
        sketch[k] += flat.square().sum()
        start += flat.numel()
    all_reduce_over(sketch, (dp_group,))
    sketch /= group_size(dp_group)
    both = torch.stack([sketch[:k].square().sum(), sketch[k]])
    all_reduce_over(both, groups)
    return both[0], both[1]
