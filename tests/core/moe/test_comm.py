"""The uneven gather / reduce-scatter of the MoE dispatcher (``core.moe.comm``): an all-gather and a
reduce-scatter of rows padded to the largest count, not all-to-alls of ``n`` copies.

One 4-rank world, counts uneven with a rank of 0 rows ([4, 0, 3, 1]) and even ([2, 2, 2, 2]).
Oracle: every rank builds every rank's tensors from the same seeds and slices them by the counts
(no collective): ``gather_v`` = their concatenation (bitwise, it moves data) and its backward =
the sum over ranks of this rank's rows of every rank's grad; ``reduce_scatter_v`` = that sum and
its backward = the concatenation of every rank's grad. The collectives are spied on: no
all-to-all, and a rank hands each collective ``max(counts)`` rows (the old form handed
``n x count``), so summed over the ranks the elements handed in drop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.moe.comm import all_gather_counts, gather_v, reduce_scatter_v
from tests.harness import run_distributed

H = 3
CASES = ([4, 0, 3, 1], [2, 2, 2, 2])
TOL = dict(rtol=1e-5, atol=1e-6)


def _rows(counts, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, H, generator=g) for c in counts]


class _Spy:
    NAMES = (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_to_all_single",
    )

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, fn in self.saved.items():

            def spy(out, inp, *a, _name=name, _fn=fn, **k):
                self.calls.append((_name, inp.numel()))
                return _fn(out, inp, *a, **k)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _world():
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(n)))
    failures, handed = [], {}
    for counts in CASES:
        m, mine = max(counts), counts[rank]
        starts = [sum(counts[:j]) for j in range(n)]
        xs = _rows(counts, 1)  # rank j's rows
        x = xs[rank].clone().requires_grad_()
        dys = [
            torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(10 + r))
            for r in range(n)
        ]
        with _Spy() as spy:
            out = gather_v(x, group, counts)
            out.backward(dys[rank])
        if not torch.equal(out, torch.cat(xs)):
            failures.append(f"{counts}: gather_v")
        want = sum(d[starts[rank] : starts[rank] + mine] for d in dys)
        if not torch.allclose(x.grad, want, **TOL):
            failures.append(f"{counts}: gather_v backward")
        if any(name == "all_to_all_single" for name, _ in spy.calls):
            failures.append(f"{counts}: an all-to-all")
        handed[str(counts)] = spy.calls[0][1]  # the gather's input
        if spy.calls[0][1] != m * H or spy.calls[1][1] != n * m * H:
            failures.append(f"{counts}: handed {spy.calls}")

        ys = [
            torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(20 + r))
            for r in range(n)
        ]
        y = ys[rank].clone().requires_grad_()
        dz = _rows(counts, 2)
        with _Spy() as spy:
            z = reduce_scatter_v(y, group, counts)
            z.backward(dz[rank])
        want = sum(t[starts[rank] : starts[rank] + mine] for t in ys)
        if z.shape != (mine, H) or not torch.allclose(z, want, **TOL):
            failures.append(f"{counts}: reduce_scatter_v")
        if not torch.equal(y.grad, torch.cat(dz)):
            failures.append(f"{counts}: reduce_scatter_v backward")
        if any(name == "all_to_all_single" for name, _ in spy.calls):
            failures.append(f"{counts}: an all-to-all")
    counts_all = all_gather_counts(torch.tensor([rank, 7 * rank]), group)
    if not torch.equal(counts_all, torch.tensor([[r, 7 * r] for r in range(n)])):
        failures.append("all_gather_counts")
    return failures, handed


def test_gather_v_and_reduce_scatter_v_equal_the_sliced_oracle_with_less_memory():
    results = run_distributed(_world, 4)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
    n = len(results)
    for counts in CASES:
        new = sum(handed[str(counts)] for _, handed in results)
        old = sum(n * c * H for c in counts)  # every rank handed n copies of its rows
        assert new == n * max(counts) * H < old, (counts, new, old)
