"""The planner's search: the fast search predicts exactly what evaluating every layout predicts,
its work is bounded, and it enumerates and ranks CP and EP (pure prediction, no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.core.pipeline_parallel import simulator
from megalite.planning import search as search_mod
from megalite.planning import step_time
from megalite.planning.cluster import preset
from megalite.planning.explain import explain, family_of
from megalite.planning.presets import MODEL_PRESETS
from megalite.planning.schedule_replay import schedule_lists
from megalite.planning.search import (
    SearchSpace,
    candidate_layouts,
    evaluate,
    lighter,
    search,
)
from megalite.training.arguments import build_parser

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
    """The fast search, with its step-time predictions and pipeline replays counted, and every
    layout evaluated on its own: no memo, cold schedule caches, one parser used in the reverse of
    the search's order (a parse that leaked into the next would show as a difference)."""
    _clear_caches()
    layouts = candidate_layouts(
        CLUSTER, global_batch_size=GBS, seq_length=4096, num_experts=4, space=SPACE
    )
    counts = {"step": 0, "simulate": 0}

    def count(name, f):
        def wrapped(*a, **k):
            counts[name] += 1
            return f(*a, **k)

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_mod, "predict_step_time", count("step", search_mod.predict_step_time))
        mp.setattr(simulator, "simulate", count("simulate", simulator.simulate))
        fast = search(MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, space=SPACE)
    counts["programs"] = step_time.pipeline_program.cache_info().currsize
    _clear_caches()
    parser = build_parser()
    every = {
        x: evaluate(
            MODEL,
            x,
            CLUSTER,
            vocab_size=VOCAB,
            global_batch_size=GBS,
            parser=parser,
            time_misfits=False,
        )
        for x in reversed(layouts)
    }
    return layouts, fast, every, counts


def _signature(c):
    return (
        c.error,
        c.fits,
        [(r.pp_rank, r.state.total, r.activations.peak) for r in c.memory],
        None if c.step is None or not c.fits else c.step.seconds,
    )


def test_fast_search_predicts_what_evaluating_every_layout_predicts(small):
    layouts, fast, every, _ = small
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
    # exhaustive: the dominated ones evaluated and ranked too (dominance holds inside a family,
    # so whole families that left out block2 and full show it)
    families = _families_with_every_outcome(layouts, fast, 3)
    part = [x for x in layouts if family_of(x) in families]
    everything = search(
        MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, layouts=part, exhaustive=True
    )
    assert everything.dominated == 0
    assert [c.layout for c in everything.ranked] == [
        c.layout for c in fitting if family_of(c.layout) in families
    ]


def test_search_enumerates_and_ranks_cp_and_ep(small):
    layouts, fast, _, _ = small
    assert {x.cp for x in layouts} == {1, 2, 4} and {x.ep for x in layouts} == {1, 2, 4}
    assert any(x.tp == 2 and x.etp == 1 for x in layouts)  # ETP 1 under TP 2
    assert any(c.layout.cp > 1 for c in fast.ranked) and any(c.layout.ep > 1 for c in fast.ranked)
    lines = explain(fast, CLUSTER)
    assert any(line.startswith("TP1 PP1 DP2 CP2: ") for line in lines)
    assert any(line.startswith("TP1 PP1 DP4 EP4: ") for line in lines)
    assert any(line.startswith("TP1 PP1 DP2 CP2 EP2: ") for line in lines)


def _families_with_every_outcome(layouts, fast, count):
    """The first ``count`` (TP, PP, CP, EP, DP) families, in the candidates' order, holding a
    ranked and a rejected layout and dominated ones under block2 and full each."""
    ranked = {family_of(c.layout) for c in fast.ranked}
    rejected = {family_of(c.layout) for c in fast.rejected}
    seen = {c.layout for c in fast.ranked + fast.rejected}
    dominated: dict[tuple, set] = {}
    for x in layouts:
        if x not in seen:
            dominated.setdefault(family_of(x), set()).add(x.recompute)
    out = []
    for x in layouts:
        f = family_of(x)
        if f in ranked and f in rejected and dominated.get(f, set()) >= {"block2", "full"}:
            out += [] if f in out else [f]
    assert len(out) >= count
    return out[:count]


def test_parallel_search_is_the_serial_search(small, monkeypatch):
    """Three whole families (one per worker and one more) on two workers merge to what the serial
    search found for them: the same candidates, order and dominated count."""
    layouts, fast, _, _ = small
    families = _families_with_every_outcome(layouts, fast, 3)
    part = [x for x in layouts if family_of(x) in families]
    monkeypatch.setattr(search_mod, "PARALLEL_FROM", 0)
    par = search(MODEL, CLUSTER, vocab_size=VOCAB, global_batch_size=GBS, layouts=part, jobs=2)
    ranked = [c for c in fast.ranked if family_of(c.layout) in families]
    rejected = [c for c in fast.rejected if family_of(c.layout) in families]
    assert [_signature(c) for c in par.ranked] == [_signature(c) for c in ranked]
    assert [c.layout for c in par.ranked] == [c.layout for c in ranked]
    assert [c.layout for c in par.rejected] == [c.layout for c in rejected]
    assert par.dominated == len(part) - len(ranked) - len(rejected) > 0


def test_search_work_is_bounded(small):
    """Step time only for layouts that fit; one pipeline replay per schedule shape and stage
    costs (the ZeRO rungs of a layout share it); one action list per schedule shape."""
    _, result, _, counts = small
    assert counts["step"] == len(result.ranked)
    piped = [c.layout for c in result.ranked if c.layout.pp > 1]
    shapes = {replace(x, rung="no_shard", offload_fraction=0.0) for x in piped}
    assert 0 < counts["simulate"] <= len(shapes) < len(piped)
    programs = {(x.schedule, x.pp, GBS // (x.micro_batch_size * x.dp), x.vp) for x in piped}
    assert counts["programs"] <= len(programs)


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
