"""The planner's search: the fast search predicts exactly what evaluating every layout predicts,
its work is bounded, and it enumerates and ranks CP and EP (pure prediction, no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.core.pipeline_parallel import simulator
from megalite.planning import search as search_mod
from megalite.planning import step_time
from megalite.planning.cluster import preset
from megalite.planning.explain import explain
from megalite.planning.presets import MODEL_PRESETS
from megalite.planning.schedule_replay import schedule_lists
from megalite.planning.search import (
    SearchSpace,
    candidate_layouts,
    evaluate,
    lighter,
    search,
)

# a MoE model with sequences long enough for CP, small enough to evaluate every layout
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8"]
MODEL += ["--seq-length", "4096", "--max-position-embeddings", "4096"]
MODEL += ["--num-experts", "4", "--moe-router-topk", "2", "--bf16"]
VOCAB, GBS = 1024, 8
SPACE = SearchSpace(micro_batch_sizes=(1, 2), interleaved_vp=(2,))
# 4.2 GiB: some layouts fit as they are, some only with recompute, some not at all
CLUSTER = preset("H100", 4, gpu_memory_gib=4.2)


def _clear_caches():
    for f in (step_time.simulated_step, step_time.pipeline_program, schedule_lists):
        f.cache_clear()


@pytest.fixture(scope="module")
def small():
    _clear_caches()
    layouts = candidate_layouts(
        CLUSTER, global_batch_size=GBS, seq_length=4096, num_experts=4, space=SPACE
    )
    fast = search(MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, space=SPACE)
    # every layout on its own: a fresh parser, no memo, step time even for misfits
    every = {
        x: evaluate(MODEL, x, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS) for x in layouts
    }
    return layouts, fast, every


def _signature(c):
    return (
        c.error,
        c.fits,
        [(r.pp_rank, r.state.total, r.activations.peak) for r in c.memory],
        None if c.step is None or not c.fits else c.step.seconds,
    )


def test_fast_search_predicts_what_evaluating_every_layout_predicts(small):
    layouts, fast, every = small
    seen = fast.ranked + fast.rejected
    assert len(seen) + fast.dominated == len(layouts)
    assert fast.ranked and fast.dominated and any(c.error is None for c in fast.rejected)
    for c in seen:  # memory, fit and step time exactly as evaluated alone
        assert _signature(c) == _signature(every[c.layout]), c.layout.name()
    order = {x: i for i, x in enumerate(layouts)}
    fitting = sorted(
        (c for c in every.values() if c.error is None and c.fits),
        key=lambda c: (-c.step.tokens_per_s, order[c.layout]),
    )

    def lighter_fits(c):
        return [
            every[replace(c.layout, recompute=r)]
            for r in SPACE.recompute
            if lighter(r, c.layout.recompute) and every[replace(c.layout, recompute=r)].fits
        ]

    def less_recompute_fits(c):
        return bool(lighter_fits(c))

    dominated = [c for c in fitting if less_recompute_fits(c)]
    assert len(dominated) == fast.dominated
    kept = [c.layout for c in fitting if not less_recompute_fits(c)]
    assert [c.layout for c in fast.ranked] == kept  # the same ranking, dominated ones left out
    assert {c.layout.recompute for c in dominated} >= {"block2", "full"}
    for c in dominated:  # none is faster than a lighter recompute of it that fits (equal when
        for light in lighter_fits(c):  # a chunk holds no more layers than the lighter block)
            assert light.step.tokens_per_s >= c.step.tokens_per_s, (light.layout, c.layout)
    everything = search(
        MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, space=SPACE, exhaustive=True
    )
    assert [c.layout for c in everything.ranked] == [c.layout for c in fitting]


def test_search_enumerates_and_ranks_cp_and_ep(small):
    layouts, fast, _ = small
    assert {x.cp for x in layouts} == {1, 2, 4} and {x.ep for x in layouts} == {1, 2, 4}
    assert any(x.tp == 2 and x.etp == 1 for x in layouts)  # ETP 1 under TP 2
    assert any(c.layout.cp > 1 for c in fast.ranked) and any(c.layout.ep > 1 for c in fast.ranked)
    lines = explain(fast, CLUSTER)
    assert any(line.startswith("TP1 PP1 DP2 CP2: ") for line in lines)
    assert any(line.startswith("TP1 PP1 DP4 EP4: ") for line in lines)
    assert any(line.startswith("TP1 PP1 DP2 CP2 EP2: ") for line in lines)


def test_parallel_search_is_the_serial_search(small, monkeypatch):
    _, fast, _ = small
    monkeypatch.setattr(search_mod, "PARALLEL_FROM", 0)
    par = search(MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, space=SPACE, jobs=2)
    assert [_signature(c) for c in par.ranked] == [_signature(c) for c in fast.ranked]
    assert [c.layout for c in par.ranked] == [c.layout for c in fast.ranked]
    assert [c.layout for c in par.rejected] == [c.layout for c in fast.rejected]
    assert par.dominated == fast.dominated


def test_search_work_is_bounded(monkeypatch):
    """Step time only for layouts that fit; one pipeline replay per schedule shape and stage
    costs (the ZeRO rungs of a layout share it); one action list per schedule shape."""
    counts = {"step": 0, "simulate": 0}
    real_step, real_simulate = search_mod.predict_step_time, simulator.simulate

    def count(name, f):
        def wrapped(*a, **k):
            counts[name] += 1
            return f(*a, **k)

        return wrapped

    monkeypatch.setattr(search_mod, "predict_step_time", count("step", real_step))
    monkeypatch.setattr(simulator, "simulate", count("simulate", real_simulate))
    _clear_caches()
    result = search(MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, space=SPACE)
    assert counts["step"] == len(result.ranked)
    piped = [c.layout for c in result.ranked if c.layout.pp > 1]
    shapes = {replace(x, rung="no_shard", offload_fraction=0.0) for x in piped}
    assert 0 < counts["simulate"] <= len(shapes) < len(piped)
    programs = {(x.schedule, x.pp, GBS // (x.micro_batch_size * x.dp), x.vp) for x in piped}
    assert step_time.pipeline_program.cache_info().currsize <= len(programs)


def test_long_sequences_rank_context_parallel_first():
    p = MODEL_PRESETS["llama3-8b"]
    argv = [*p["argv"], "--bf16"]
    for flag in ("--seq-length", "--max-position-embeddings"):
        argv[argv.index(flag) + 1] = "65536"
    cluster = preset("H100", 8)
    result = search(argv, cluster, vocab_size=p["vocab_size"], global_batch_size=8)
    best = result.ranked[0].layout
    assert best.cp > 1, best.name()
    no_cp = [c for c in result.ranked if c.layout.cp == 1]
    assert no_cp and no_cp[0].step.tokens_per_s < 0.9 * result.ranked[0].step.tokens_per_s


def test_moe_ranks_expert_parallel_first():
    p = MODEL_PRESETS["mixtral-8x7b"]
    cluster = preset("H100", 16)
    space = SearchSpace(micro_batch_sizes=(1,), interleaved_vp=(2,), recompute=(None, "full"))
    argv = [*p["argv"], "--bf16"]
    result = search(argv, cluster, vocab_size=p["vocab_size"], global_batch_size=16, space=space)
    assert result.ranked[0].layout.ep == 8, result.ranked[0].layout.name()
    # without EP each rank of a stage holds every expert, sharded by TP or ZeRO-3 at best: those
    # layouts pay TP traffic, bubbles or per-unit gathers that EP does not
    dense = [c for c in result.ranked if c.layout.ep == 1]
    assert dense and dense[0].step.tokens_per_s < result.ranked[0].step.tokens_per_s
