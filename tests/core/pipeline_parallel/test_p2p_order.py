"""The pipeline executor's point-to-point traffic is right on a backend that ignores tags (nccl).

nccl matches the messages of one direction between two ranks in posting order (FIFO), and runs a
rank's batches of p2p ops one after the other on one stream. The executor posts exactly what
``actions.posting_plan`` lists (compute actions, and tuples of ops each posted as ONE
``batch_isend_irecv``), so these checks read that plan, with every tag 0, for all six schedules
over p in {2, 4, 8}, m in {p, 2p, 2p + 1} (where legal), v in {1, 2} (3 for interleaved):

- FIFO: the n-th message a rank sends to a peer is the n-th it receives from it (same micro-batch,
  stage and direction); otherwise a micro-batch silently gets another's activation;
- pairing: the k-th batch of a rank holding ops with a peer holds, in the same order, the mirror of
  the peer's k-th such batch;
- no deadlock: replaying every rank's batches in posting order, a batch completing only while the
  batches of all its ops' partners are at the head of their ranks' queues (the strictest reading
  of a grouped nccl launch), every batch completes;
- data: each receive is posted before its consumer computes, each send after its producer.

The old placement (one op per action, receives a compute early) fails them (a control, so the
checks can fail). End to end: every tag 0 on gloo (which then matches by posting order, checked
first), zbv, dualpipev, interleaved and zb-h1 at PP 4 and PP 2 equal no pipelining.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel import actions as actions_mod
from megalite.core.pipeline_parallel.actions import Action, p2p_program, posting_plan
from megalite.core.pipeline_parallel.forward_backward import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
)
from megalite.core.pipeline_parallel.generators import (
    SCHEDULES,
    V_SHAPED,
    check_schedule,
    generate,
    layout_of,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.models import GPTModel
from megalite.training.model_chunks import build_gpt_chunks, stage_blocks, tied_params
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, weighted_lm_step

# chunks per rank to try, every schedule of SCHEDULES: one, unless it takes several
CHUNKS = {
    **dict.fromkeys(SCHEDULES, (1,)),
    "interleaved-1f1b": (2, 3),
    "zb-h1": (1, 2),
    **dict.fromkeys(V_SHAPED, (2,)),
}


def _grid():
    for schedule in SCHEDULES:
        for p in (2, 4, 8):
            for m in (p, 2 * p, 2 * p + 1):
                for v in CHUNKS[schedule]:
                    for g in (None, m) if schedule == "interleaved-1f1b" else (None,):
                        try:
                            check_schedule(
                                schedule,
                                pp_size=p,
                                num_microbatches=m,
                                num_chunks=v,
                                microbatch_group_size=g,
                            )
                        except ValueError:
                            continue
                        yield schedule, p, m, v, g


def _plans(schedule, p, m, v, g, *, forward_only=False, programs=None):
    layout = layout_of(schedule, p, v)
    if programs is None:
        compute = generate(
            schedule,
            pp_size=p,
            num_microbatches=m,
            num_chunks=v,
            microbatch_group_size=g,
            forward_only=forward_only,
        )
        programs = p2p_program(compute, layout)
    return layout, [posting_plan(programs[r], layout, r, tagged=False) for r in range(p)]


def _problems(layout, plans) -> list[str]:
    """Everything wrong with the per-rank posting plans, as nccl would run them (tags ignored)."""
    p, bad = len(plans), []
    msg = lambda op: (op.kind, op.microbatch, op.stage)  # noqa: E731
    batches = [[b for b in plan if not isinstance(b, Action)] for plan in plans]
    # FIFO: per direction, the sender's order of messages is the receiver's
    for a in range(p):
        for b in range(p):
            sent = [msg(op) for bt in batches[a] for op in bt if op.send and op.peer == b]
            got = [msg(op) for bt in batches[b] for op in bt if not op.send and op.peer == a]
            if sent != got:
                bad.append(f"FIFO {a}->{b}: sent {sent[:6]}... received {got[:6]}...")
            assert all(op.tag == 0 for bt in batches[a] for op in bt)
    # pairing: the k-th batch with a peer mirrors the peer's k-th batch with us
    for a in range(p):
        for b in range(p):
            mine = [[(msg(op), op.send) for op in bt if op.peer == b] for bt in batches[a]]
            theirs = [[(msg(op), not op.send) for op in bt if op.peer == a] for bt in batches[b]]
            if [x for x in mine if x] != [x for x in theirs if x]:
                bad.append(f"pairing {a}<->{b}: batches differ")
    # no deadlock: a batch completes only with every partner batch at the head of its queue
    seq = {}  # (sender, receiver, n) -> (rank, batch index) of both ends, by posting order
    for r in range(p):
        count: dict = {}
        for k, bt in enumerate(batches[r]):
            for op in bt:
                pair = (r, op.peer) if op.send else (op.peer, r)
                n = count[pair, op.send] = count.get((pair, op.send), -1) + 1
                seq.setdefault((*pair, n), {})[op.send] = (r, k)
    head = [0] * p
    while any(head[r] < len(batches[r]) for r in range(p)):
        ready = {r for r in range(p) if head[r] < len(batches[r])}
        changed = True
        while changed:
            changed = False
            for r in list(ready):
                count: dict = {}
                for k, bt in enumerate(batches[r][: head[r] + 1]):
                    for op in bt:
                        pair = (r, op.peer) if op.send else (op.peer, r)
                        n = count[pair, op.send] = count.get((pair, op.send), -1) + 1
                        if k < head[r]:
                            continue
                        other = seq.get((*pair, n), {}).get(not op.send)
                        if other is None or other[0] not in ready or head[other[0]] != other[1]:
                            ready.discard(r)
                            changed = True
                            break
                    if r not in ready:
                        break
        if not ready:
            stuck = {r: head[r] for r in range(p) if head[r] < len(batches[r])}
            bad.append(f"deadlock: ranks stuck at batches {stuck}")
            break
        for r in ready:
            head[r] += 1
    # data: a receive before its consumer, a send after its producer
    for r, plan in enumerate(plans):
        posted, done = set(), set()
        for item in plan:
            if isinstance(item, Action):
                s = layout.stage(r, item.chunk)
                done.add((item.op, item.microbatch, s))
                need = actions_mod._needs(item, r, layout)
                if need is not None and need not in posted:
                    bad.append(f"rank {r}: {item} before its receive")
                continue
            for op in item:
                if not op.send:
                    posted.add(msg(op))
                    continue
                src = op.stage - 1 if op.kind == "F" else op.stage + 1
                made = ("F",) if op.kind == "F" else ("B", "I")
                if not any((o, op.microbatch, src) in done for o in made):
                    bad.append(f"rank {r}: sends {msg(op)} before computing it")
    return bad


def test_every_schedule_posts_fifo_paired_deadlock_free_batches():
    cases = 0
    for schedule, p, m, v, g in _grid():
        for forward_only in (False, True):
            layout, plans = _plans(schedule, p, m, v, g, forward_only=forward_only)
            bad = _problems(layout, plans)
            assert not bad, (schedule, p, m, v, g, forward_only, bad[:3])
            cases += 1
    assert cases >= 80, cases


@pytest.mark.parametrize(
    "schedule, p, m, v",
    [
        ("1f1b", 4, 8, 1),
        ("gpipe", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("zb-h1", 4, 8, 1),
        ("zb-h1", 2, 4, 2),
        ("zbv", 4, 8, 2),
        ("dualpipev", 4, 8, 2),
    ],
)
def test_each_direction_receives_in_the_order_it_is_sent(schedule, p, m, v):
    # the cases that were strict xfails before the executor posted batches (CUDA_AUDIT.md)
    layout, plans = _plans(schedule, p, m, v, None)
    assert not [b for b in _problems(layout, plans) if b.startswith("FIFO")]


def test_1f1b_pair_op_orders_agree_for_nccl_p2p():
    layout, plans = _plans("1f1b", 2, 4, 1, None)
    assert not _problems(layout, plans)


@pytest.mark.parametrize(
    "schedule, v, share",
    [("gpipe", 1, 0.8), ("interleaved-1f1b", 2, 0.4), ("zb-h1", 2, 0.6), ("dualpipev", 2, 0.6)],
)
def test_receives_are_posted_ahead_of_the_compute_before_their_consumer(schedule, v, share):
    """Overlap: a receive is posted before the receiver's previous compute wherever the batches
    still pair up (the transfer overlaps that compute); p 4, m 8."""
    layout, plans = _plans(schedule, 4, 8, v, None)
    ahead = []
    for r, plan in enumerate(plans):
        posted, n = {}, 0
        for item in plan:
            if isinstance(item, Action):
                need = actions_mod._needs(item, r, layout)
                if need is not None:
                    ahead.append(n - posted[need] >= 1)
                n += 1
            else:
                posted.update({(op.kind, op.microbatch, op.stage): n for op in item if not op.send})
    assert sum(ahead) / len(ahead) >= share, sum(ahead) / len(ahead)


def test_with_p2p_is_the_program_the_executor_posts():
    # the lists the simulator and the timeline read are the executor's batches, flattened
    for schedule, p, m, v in [("zbv", 4, 8, 2), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 9, 2)]:
        layout = layout_of(schedule, p, v)
        compute = generate(schedule, pp_size=p, num_microbatches=m, num_chunks=v)
        flat = actions_mod.with_p2p(compute, layout)
        programs = p2p_program(compute, layout)
        assert flat == [actions_mod.flatten(program) for program in programs]
        assert [[a for a in acts if a.op in "FBIW"] for acts in flat] == compute


@pytest.mark.parametrize(
    "schedule, p, m, v, broken",
    [
        ("1f1b", 2, 4, 1, "deadlock"),
        ("zb-h1", 2, 4, 2, "FIFO"),
        ("zbv", 4, 8, 2, "FIFO"),
        ("dualpipev", 4, 8, 2, "FIFO"),
    ],
)
def test_the_checks_catch_the_old_placement(schedule, p, m, v, broken):
    """The old executor posted each SEND / RECV action alone, receives one compute early."""
    layout = layout_of(schedule, p, v)
    compute = generate(schedule, pp_size=p, num_microbatches=m, num_chunks=v)
    old = actions_mod._with_p2p_per_action(compute, layout, overlap=True)
    _, plans = _plans(schedule, p, m, v, None, programs=old)
    assert any(problem.startswith(broken) for problem in _problems(layout, plans))


# --- end to end on gloo, every tag 0 ------------------------------------------------------------

LAYERS = 8
TOL = dict(rtol=1e-5, atol=1e-6)
E2E = {  # pp -> (schedule, v, m, overlap)
    4: [
        ("zbv", 2, 8, True),
        ("dualpipev", 2, 9, True),
        ("interleaved-1f1b", 2, 8, True),
        ("zb-h1", 2, 4, False),
    ],
    2: [
        ("zbv", 2, 5, True),
        ("dualpipev", 2, 4, False),
        ("interleaved-1f1b", 2, 4, True),
        ("zb-h1", 2, 5, True),
    ],
}


def _gloo_matches_tag_zero_by_posting_order() -> list[float]:
    """Rank 0 sends 0..4 with tag 0 (in two batches), rank 1 receives them (in other batches)."""
    got = []
    if dist.get_rank() == 0:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((3,), float(i)), 1, tag=0) for i in range(3)]
        )
        works += dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((3,), float(i)), 1, tag=0) for i in (3, 4)]
        )
    elif dist.get_rank() == 1:
        bufs = [torch.empty(3) for _ in range(5)]
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0, tag=0) for b in bufs[:2]])
        works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0, tag=0) for b in bufs[2:]])
    else:
        works = []
    for w in works:
        w.wait()
    if dist.get_rank() == 1:
        got = [float(b[0]) for b in bufs]
    return got


def _tag_blind_world():
    order = _gloo_matches_tag_zero_by_posting_order()
    config = make_config("gpt2", num_layers=LAYERS)
    oracles = {}
    failures, count = [], 0
    for pp, cases in E2E.items():
        ps = mesh(1, pp)
        for schedule, v, m, overlap in cases:
            if m not in oracles:
                model = GPTModel(config, ParallelState.single())
                batches = [make_batch(config, seed=200 + i) for i in range(m)]
                losses = forward_backward_no_pipelining(
                    forward_step_func=weighted_lm_step,
                    data_iterator=[iter(batches)],
                    model=[ModelChunk(model)],
                    num_microbatches=m,
                )
                grads = {n: q.grad for n, q in model.named_parameters()}
                oracles[m] = batches, [d["lm loss"] for d in losses], grads
            batches, want_losses, want_grads = oracles[m]
            chunks = build_gpt_chunks(config, ps, schedule=schedule, num_chunks=v)
            p2p = P2PCommunicator(
                prev_rank=ps.prev_rank,
                next_rank=ps.next_rank,
                tensor_shape=(config.seq_length, 2, config.hidden_size),
                dtype=torch.float32,
                device=torch.device("cpu"),
                group=ps.pp_group,
                pp_ranks=ps.pp_ranks,
                overlap=overlap,
                tagged=False,
            )
            it = iter(batches)
            losses = forward_backward_pipelining(
                schedule=schedule,
                forward_step_func=weighted_lm_step,
                data_iterator=[it] * len(chunks),
                model=[ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)],
                num_microbatches=m,
                p2p=p2p,
                pp_rank=ps.pp_rank,
                pp_size=pp,
            )
            shared, _ = tied_params(chunks, ps)
            for w in shared:
                dist.all_reduce(w.grad, group=ps.embedding_group)
            count += 1
            label = f"pp{pp} {schedule} v{v} m{m} overlap={overlap}"
            try:
                if ps.is_last_stage:
                    assert len(losses) == m, f"{len(losses)} losses"
                    for got, want in zip(losses, want_losses):
                        torch.testing.assert_close(got["lm loss"], want, **TOL)
                layout = layout_of(schedule, pp, v)
                blocks = stage_blocks(config, layout)
                for c, chunk in enumerate(chunks):
                    start = blocks[layout.stage(ps.pp_rank, c)][0]
                    for name, param in chunk.named_parameters():
                        key = name
                        if name.startswith("decoder.layers."):
                            _, _, i, rest = name.split(".", 3)
                            key = f"decoder.layers.{int(i) + start}.{rest}"
                        if key not in want_grads:  # a tied copy on the last stage
                            key = "embedding.word_embeddings.weight"
                        torch.testing.assert_close(param.grad, want_grads[key], **TOL)
            except AssertionError as e:
                failures.append(f"rank {dist.get_rank()} {label}: {str(e).splitlines()[0][:160]}")
    return order, count, failures


def test_tag_blind_gloo_runs_every_v_schedule_equal_to_no_pipelining():
    results = run_distributed(_tag_blind_world, 4, timeout=600)
    assert results[1][0] == [0.0, 1.0, 2.0, 3.0, 4.0]  # gloo matches tag 0 in posting order
    assert results[0][1] == sum(len(c) for c in E2E.values())
    failures = [f for _, _, fs in results for f in fs]
    assert not failures, "\n".join(failures[:20])
