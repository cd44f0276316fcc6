"""What the pipeline executor's point-to-point traffic needs on nccl, checked on the action lists.

The executor posts each SEND / RECV action as its own ``isend`` / ``irecv`` with a tag per
(direction, micro-batch, stage); gloo matches by tag, so any order runs on CPU. nccl ignores tags:
between two ranks, messages of one direction match in posting order (FIFO), and every unbatched
op of the pair runs in posting order on the pair's one stream. Two properties follow:

- FIFO: for each ordered pair (a -> b), the messages a sends are the messages b receives, in the
  same order; otherwise a micro-batch receives another's activation (same shape: silently wrong).
- pairing: each rank's op sequence on the pair equals the peer's with send and recv swapped;
  otherwise a lone send waits for a recv queued behind the peer's own lone send (a hang) unless
  the ops of a tick are posted as one ``batch_isend_irecv``.

Cases known to break a property are strict xfails (docs/CUDA_AUDIT.md; the fix is in the executor
/ generators, issue 14's files): when a fix lands they fail, and the mark goes.
"""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of


def _pair_ops(schedule: str, p: int, m: int, v: int, overlap: bool) -> dict:
    """(rank, peer) -> that rank's p2p ops with the peer in posting order, (message, direction)."""
    layout = layout_of(schedule, p, v)
    lists = with_p2p(generate(schedule, pp_size=p, num_microbatches=m, num_chunks=v), layout,
                     overlap=overlap)  # fmt: skip
    out: dict = {}
    for r, actions in enumerate(lists):
        for a in actions:
            s = layout.stage(r, a.chunk)
            peer_stage, kind, d, dst = {
                "SEND_F": (s + 1, "F", "send", s + 1),
                "SEND_B": (s - 1, "B", "send", s - 1),
                "RECV_F": (s - 1, "F", "recv", s),
                "RECV_B": (s + 1, "B", "recv", s),
            }.get(a.op, (None, None, None, None))
            if peer_stage is not None:
                peer = layout.place(peer_stage)[0]
                out.setdefault((r, peer), []).append(((kind, a.microbatch, dst), d))
    return out


def _xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


FIFO_BREAKS = "nccl matches by order, not tag: messages of one direction cross (CUDA_AUDIT.md)"


@pytest.mark.parametrize(
    "schedule, p, m, v",
    [
        ("1f1b", 4, 8, 1),
        ("gpipe", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("zb-h1", 4, 8, 1),
        pytest.param("zb-h1", 2, 4, 2, marks=_xfail(FIFO_BREAKS)),
        pytest.param("zbv", 4, 8, 2, marks=_xfail(FIFO_BREAKS)),
        pytest.param("dualpipev", 4, 8, 2, marks=_xfail(FIFO_BREAKS)),
    ],
)
def test_each_direction_receives_in_the_order_it_is_sent(schedule, p, m, v):
    ops = _pair_ops(schedule, p, m, v, overlap=True)
    for (a, b), seq in ops.items():
        sent = [msg for msg, d in seq if d == "send"]
        received = [msg for msg, d in ops.get((b, a), []) if d == "recv"]
        assert sent == received, (schedule, a, b)


@pytest.mark.xfail(strict=True, reason="unbatched isend/irecv: the pair's op orders differ")
def test_1f1b_pair_op_orders_agree_for_unbatched_nccl_p2p():
    ops = _pair_ops("1f1b", 2, 4, 1, overlap=True)
    for (a, b), seq in ops.items():
        swapped = [(msg, "recv" if d == "send" else "send") for msg, d in ops[(b, a)]]
        assert seq == swapped, (a, b)
