"""The search over tensor-parallel modes (pure prediction, no processes): a grid or cube TP group
may span nodes and wins where it should, 1d wins a small model on one node, and each mode's
collectives are charged the link their sub-group crosses."""

from __future__ import annotations

import dataclasses

from megalite.models.config import GPTConfig
from megalite.planning.cluster import bus_factor, preset
from megalite.planning.explain import explain
from megalite.planning.search import SearchSpace, candidate_layouts, search
from megalite.planning.tp_modes import layer_comms

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0", "--bf16"]


def _model(layers: int, hidden: int, heads: int, seq: int) -> list[str]:
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    argv += ["--num-attention-heads", str(heads), "--seq-length", str(seq)]
    return argv + ["--max-position-embeddings", str(seq), *NO_DROPOUT]


def test_a_grid_mode_spanning_slow_nodes_ranks_first_and_explain_says_why():
    """Nodes of 4 GPUs on slow links, a wide one-layer model, 4 sequences a step: 1d TP stops at
    a node, so 1d layouts reduce their grads over DP across the slow links (no PP with one
    layer, no CP at this length); 3d over both nodes keeps its activation collectives and its
    weights' gathers inside a node and ranks first."""
    cluster = preset("H100", 8, gpus_per_node=4, inter_node_gbps=5.0)
    space = SearchSpace(micro_batch_sizes=(1, 2, 4), recompute=(None,))
    argv = _model(1, 8192, 64, 512)
    layouts = candidate_layouts(cluster, global_batch_size=4, seq_length=512, space=space)
    assert all(x.tp <= 4 for x in layouts if x.tp_mode == "1d")
    assert {(x.tp, x.tp_mode) for x in layouts if x.tp > 4} == {(8, "2.5d"), (8, "3d")}
    result = search(argv, cluster, vocab_size=1024, global_batch_size=4, space=space)
    best = result.ranked[0]
    assert (best.layout.tp, best.layout.tp_mode) == (8, "3d"), best.layout.name()
    one_d = next(c for c in result.ranked if c.layout.tp_mode == "1d")
    assert one_d.step.tokens_per_s < 0.5 * best.step.tokens_per_s
    (line,) = [x for x in explain(result, cluster) if x.startswith("TP8-3d PP1 DP1:")]
    assert "best is #1" in line and "3d beats 1d here" in line and "across nodes" in line
    assert f"the best 1d layout is #{result.ranked.index(one_d) + 1}" in line
    assert sum("beats 1d" in x for x in explain(result, cluster)) == 1


def test_on_one_node_1d_wins_a_small_model():
    cluster = preset("H100", 8)
    space = SearchSpace(micro_batch_sizes=(1, 2, 4, 8), recompute=(None,))
    argv = _model(2, 512, 8, 1024)
    result = search(argv, cluster, vocab_size=1024, global_batch_size=16, space=space)
    assert result.ranked[0].layout.tp_mode == "1d", result.ranked[0].layout.name()
    grids = [c for c in result.ranked if c.layout.tp_mode != "1d"]
    assert {c.layout.tp_mode for c in grids} == {"2d", "2.5d", "3d"}  # they fit, and rank lower
    assert not any("beats 1d" in x for x in explain(result, cluster))


def test_each_sub_group_is_charged_the_link_it_spans():
    """2d over TP 16 (q = 4) on nodes of 8: a grid row (the activations' gathers and the norms'
    statistics) is 4 consecutive ranks, inside a node; a grid column (the weights) and the d x q
    copies of a bias or a norm scale span 16 ranks, across nodes. The seconds of one layer's
    collectives are those of the README's terms at each link's bandwidth."""
    c = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=8, vocab_size=32, seq_length=32)
    links = dict(collective_latency_s=0.0, intra_node_gbps=100.0, inter_node_gbps=10.0)
    cluster = dataclasses.replace(preset("H100", 16), **links)
    q, s, b, h, e = 4, 32, 8, 64, 2
    fwd, bwd = layer_comms(c, mode="2d", tp=16, micro_batch_size=b, e=e)
    got = sum(cluster.collective_seconds(x.op, x.nbytes, x.n, x.span) * x.count for x in fwd + bwd)
    t = s * b // q
    ring, reduce = bus_factor("all_gather", q), bus_factor("all_reduce", q)
    inputs = 3 * ring * t * (h + h + h + 4 * h) * e  # AG forward, AG + RS backward, per linear
    # the norms' statistics and every grad sum run in fp32 (4 bytes), the rest in e
    stats = 2 * 2 * 2 * reduce * t * 4  # 2 norms x (mean, variance) x forward and backward
    # weight blocks: all-gathered forward and backward in e, their grads reduce-scattered in fp32
    weights = (2 * e + 4) * ring * (3 * h * h + h * h + 4 * h * h + 4 * h * h) // q
    small = reduce * (3 * h + h + 4 * h + h + 2 * 2 * h) // q * 4  # biases, norm scales / shifts
    intra, inter = (inputs + stats) / 100e9, (weights + small) / 10e9
    assert abs(got - (intra + inter)) <= 1e-12 * got, (got, intra, inter)
