"""The op recorder sees the communication of ZeRO-3's parameter gathers and of context-parallel
attention (ring p2p, all-to-all, all-gather), not only the pipeline's and the grad buckets': a
real step on 2 gloo ranks with the recorder on, then every rank's records compared. Each message
one rank sends is the one its peer receives (same channel, sequence number, purpose and shape),
and each collective is entered by every rank of its group with the same sequence number and
purpose; that is what lets the hang explainer line the ranks up.
"""

from __future__ import annotations

import torch

from megalite.core.context_parallel import CP_COMM_TYPES, context_parallel_attention, split_for_cp
from megalite.core.op_record import RECORDER
from tests.core.distributed.test_zero2_zero3 import run, setup
from tests.harness import run_distributed
from tests.mesh import mesh


def _recorded(fn) -> list[dict]:
    RECORDER.enable(capacity=4096)
    try:
        fn()
        return [r.as_dict() for r in RECORDER.records()]
    finally:
        RECORDER.disable()


def _zero3_case() -> list[dict]:
    def step():
        model, opt = setup("optim_grads_params")
        run(model, opt, [0, 1])

    return _recorded(step)


def _cp_case(comm_type: str) -> list[dict]:
    ps = mesh(1, 1, cp=2)

    def attention():
        torch.manual_seed(3)
        q, k, v, dout = (torch.randn(1, 2, 8, 4) for _ in range(4))
        local = [split_for_cp(t, 2, 2, ps.cp_rank).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(
            *local, cp_group=ps.cp_group, comm_type=comm_type, scale=0.5
        )
        out.backward(split_for_cp(dout, 2, 2, ps.cp_rank))

    try:
        return _recorded(attention)
    finally:
        ps.destroy()


def _key(r: dict) -> tuple:
    return tuple(r["channel"]), r["seq"], r["what"], tuple(r["shape"])


def _collectives(records: list[dict], op: str) -> list[tuple]:
    return [_key(r) for r in records if r["op"] == op]


def test_zero3_parameter_gathers_are_recorded_and_line_up_across_ranks():
    ranks = run_distributed(_zero3_case, 2)
    gathers = [_collectives(records, "all_gather") for records in ranks]
    assert gathers[0] == gathers[1]
    whats = {what for _, _, what, _ in gathers[0]}
    # the tiny model's units each gather (forward, and again in backward), over two steps
    assert any(w.startswith("params of unit 0 ") for w in whats), whats
    assert any(w.startswith("params of unit 1 ") for w in whats), whats
    seqs = [seq for _, seq, _, _ in gathers[0]]  # the group's counter: other collectives too
    assert seqs == sorted(set(seqs)), seqs
    assert all(r["state"] == "done" for records in ranks for r in records)


def _cp_cases() -> dict:
    return {comm: _cp_case(comm) for comm in CP_COMM_TYPES}


def test_context_parallel_messages_are_recorded_and_line_up_across_ranks():
    ranks = run_distributed(_cp_cases, 2)
    for comm in CP_COMM_TYPES:
        a, b = ranks[0][comm], ranks[1][comm]
        assert all(r["state"] == "done" for r in a + b), comm
        if comm == "p2p":
            for sender, receiver, me, peer in ((a, b, 0, 1), (b, a, 1, 0)):
                sent = [_key(r) for r in sender if r["op"] == "send" and r["axis"] == "cp"]
                got = [_key(r) for r in receiver if r["op"] == "recv" and r["peer"] == me]
                assert sent and sent == got, (comm, me, peer)
                whats = {k[2] for k in sent}
                assert whats == {
                    "keys and values (forward)",
                    "keys and values (backward)",
                    "key and value grads",
                }, whats
            continue
        ops = {"a2a": ("all_to_all",), "all_gather": ("all_gather", "reduce_scatter")}[comm]
        for op in ops:
            mine = _collectives(a, op)
            assert mine and mine == _collectives(b, op), (comm, op)
