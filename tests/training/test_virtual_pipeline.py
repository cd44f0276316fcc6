"""Every pipeline schedule on the GPT model = no pipelining: each micro-batch's loss and every grad.

One spawned world per PP size (2 and 4) runs all the cases: schedule x m in {p, 2p, 2p + 1} (where
the schedule allows it) x v in {1, 2} (where it applies) x two of {GPT-2 tied, GPT-2 untied, Llama
tied, Llama untied} (alternating, so every schedule meets all four), with p2p overlap on and (for
one m) off. The chunks are built by
``model_chunks.build_gpt_chunks`` (Megatron's layer assignment for the loop layout, stage order for
the V); the oracle is the whole model in the same process (``ParallelState.single()``), same seed,
run by ``forward_backward_no_pipelining``; each chunk's local layer ``i`` is compared with the
oracle's global layer ``start + i``. Tied embeddings on different ranks: the copies' grads are
summed over the embedding group (what the data-parallel wrapper does). fp32, rtol 1e-5: only the
order of the micro-batch sums differs. The model has ``2 pp`` layers (one per chunk at v 2); each
oracle is computed once, on one rank, and broadcast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.forward_backward import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
)
from megalite.core.pipeline_parallel.generators import (
    SCHEDULES,
    V_SHAPED,
    check_schedule,
    layout_of,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.errors import ConfigError
from megalite.models import GPTModel
from megalite.training.model_chunks import build_gpt_chunks, stage_blocks, tied_params
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, weighted_lm_step
from tests.training.common import config

TOL = dict(rtol=1e-5, atol=1e-6)
COMBOS = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)]
# chunks per rank to try, every schedule of SCHEDULES: one, unless it takes several
SCHEDULE_CHUNKS = {
    **dict.fromkeys(SCHEDULES, (1,)),
    "interleaved-1f1b": (2,),
    "zb-h1": (1, 2),
    **dict.fromkeys(V_SHAPED, (2,)),
}


def _global_name(name: str, offset: int) -> str:
    if name == "output_layer.weight":  # the oracle's tied weight has the embedding's name
        return name
    if name.startswith("decoder.layers."):
        _, _, i, rest = name.split(".", 3)
        return f"decoder.layers.{int(i) + offset}.{rest}"
    return name


def _oracle(family, tied, m, layers):
    config = make_config(family, num_layers=layers, untie_embeddings_and_output_weights=not tied)
    model = GPTModel(config, ParallelState.single())
    batches = [make_batch(config, seed=100 + i) for i in range(m)]
    losses = forward_backward_no_pipelining(
        forward_step_func=weighted_lm_step,
        data_iterator=[iter(batches)],
        model=[ModelChunk(model)],
        num_microbatches=m,
    )
    grads = {n: p.grad for n, p in model.named_parameters()}
    return config, batches, [d["lm loss"] for d in losses], grads


def _cases(pp):
    """Two of the four model variants per (schedule, v, m), alternating, so each schedule meets
    all four over its micro-batch counts."""
    for schedule, vs in SCHEDULE_CHUNKS.items():
        j = 0
        for v in vs:
            for m in (pp, 2 * pp, 2 * pp + 1):
                # interleaved with m = 2p + 1: one group of all (Megatron's rule on the remainder)
                g = m if schedule == "interleaved-1f1b" and m % pp else None
                try:
                    check_schedule(
                        schedule,
                        pp_size=pp,
                        num_microbatches=m,
                        num_chunks=v,
                        microbatch_group_size=g,
                    )
                except ValueError:
                    continue
                pair = (COMBOS[0], COMBOS[3]) if j % 2 == 0 else (COMBOS[1], COMBOS[2])
                j += 1
                for k, (family, tied) in enumerate(pair):
                    overlap = not (m == 2 * pp and k == 0)
                    yield schedule, v, m, g, family, tied, overlap


def _oracles(pp, layers) -> dict:
    """Every oracle the cases need, each computed on one rank (spread over the ranks) and
    broadcast: a single-process run either way, not repeated pp times."""
    keys = list(dict.fromkeys((family, tied, m) for _, _, m, _, family, tied, _ in _cases(pp)))
    world, rank = dist.get_world_size(), dist.get_rank()
    oracles = {}
    for i, key in enumerate(keys):
        box = [_oracle(*key, layers) if i % world == rank else None]
        dist.broadcast_object_list(box, src=i % world)
        oracles[key] = box[0]
    return oracles


def _world(pp):
    ps = mesh(1, pp)
    layers = 2 * pp  # v 2: one layer per chunk (the largest v the cases use)
    oracles = _oracles(pp, layers)
    failures, count = [], 0
    for schedule, v, m, g, family, tied, overlap in _cases(pp):
        config, batches, want_losses, want_grads = oracles[(family, tied, m)]
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
            microbatch_group_size=g,
        )
        shared, _ = tied_params(chunks, ps)  # copies on two ranks (not a V's one Parameter)
        for w in shared:
            dist.all_reduce(w.grad, group=ps.embedding_group)
        label = (
            f"{schedule} v{v} m{m} g{g} {family} {'tied' if tied else 'untied'} overlap={overlap}"
        )
        count += 1
        try:
            if ps.is_last_stage:
                assert len(losses) == m, f"{len(losses)} losses"
                for got, want in zip(losses, want_losses):
                    torch.testing.assert_close(got["lm loss"], want, **TOL)
            else:
                assert losses == [], "losses off the last rank"
            layout = layout_of(schedule, pp, v)
            blocks = stage_blocks(config, layout)
            for c, chunk in enumerate(chunks):
                start = blocks[layout.stage(ps.pp_rank, c)][0]
                for name, param in chunk.named_parameters():
                    key = _global_name(name, start)
                    if key not in want_grads:  # a tied copy on the last stage
                        key = "embedding.word_embeddings.weight"
                    want = want_grads[key]
                    assert param.grad is not None, f"{name}: no grad"
                    torch.testing.assert_close(param.grad, want, **TOL, msg=lambda s, n=name: n)
        except AssertionError as e:
            failures.append(f"rank {ps.pp_rank} {label}: {str(e).splitlines()[0][:160]}")
    return count, failures


def _check(pp):
    results = run_distributed(_world, pp, pp, timeout=600)
    count = results[0][0]
    assert count >= 20, count  # every schedule, every m it allows, two model variants each
    failures = [f for _, fs in results for f in fs]
    assert not failures, "\n".join(failures[:20])


def test_every_schedule_equals_no_pipelining_pp2():
    _check(2)


def test_every_schedule_equals_no_pipelining_pp4():
    _check(4)


def test_schedule_flags_are_checked_with_one_line_errors():
    """The pipeline settings are checked when the flags are parsed; the messages name the config
    fields, which the flag layer writes as the flags the user gave."""
    pp4 = ("--pipeline-model-parallel-size", "4", "--num-layers", "8")
    cases = [
        ("--pipeline-schedule dualpipev", "num_microbatches >= 2 x pp = 8, got 4"),
        ("--num-layers-per-virtual-pipeline-stage 3", "not divisible by"),
        (
            "--num-virtual-stages-per-pipeline-rank 2 "
            "--microbatch-group-size-per-virtual-pipeline-stage 3",
            "--microbatch-group-size-per-virtual-pipeline-stage 3 must lie in [pp 4",
        ),
        (
            "--pipeline-schedule zbv --num-virtual-stages-per-pipeline-rank 3",
            "exactly 2 chunks per rank in a V, got --num-virtual-stages-per-pipeline-rank 3",
        ),
        (
            "--num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 2",
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are mutually exclusive",
        ),
    ]
    for flags, words in cases:
        with pytest.raises(ConfigError) as e:
            config(*pp4, *flags.split(), world_size=4)
        assert words in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
    ok = config(*pp4, "--num-virtual-stages-per-pipeline-rank", "2", world_size=4)
    assert ok.parallel.num_virtual_stages_per_pipeline_rank == 2
