"""The planner's step time is what a real step does, priced at the cluster's rates: counted, not
timed.

For each layout, one training step of pretrain_gpt.py's run (``accuracy.build_world_run``) on two
gloo ranks is counted on every rank (``StepCounter``): the matrix-multiply FLOPs of every op it
runs (``torch.utils.flop_counter``'s formulas; the unfused attention, whose two batched GEMMs are
ops it sees), forward and backward apart (recomputation runs inside backward); every collective
and message (``measure.comm_log.CommLog``); the forward passes of the transformer layers and of
the model chunks. A made-up cluster (``CLUSTER``) prices them: FLOPs at a rate, a collective at its
bytes over a bandwidth (``Cluster.collective_seconds``, no latency), a fixed cost per layer pass
(one forward, two backward: what the planner charges) and per chunk pass (forward and backward).
The planner's ``predict_step_time`` on that cluster must be that price, within 1e-4 relative (the
grad norm's one-number all-reduces: the planner charges ``step_traffic``'s count of them). The
ZeRO rungs run without ``--overlap-grad-reduce`` on both sides: how much of a reduction hides
behind backward is a claim about time, which a count cannot check (``bench_planner.py`` measures
those layouts as the planner proposes them):

- one stage (DP with each ZeRO rung, full recompute, TP, TP with SP, selective recompute): the
  slowest rank's priced work, every FLOP, collective and pass of its step;
- two stages (1F1B, GPipe): the schedule's action lists (``generate`` + ``with_p2p``, as the
  executor runs them) replayed by ``simulate`` at each stage's priced forward and backward of one
  micro-batch (its counted work over m) with the message at its priced bytes, plus the
  collectives outside the passes (the tied embedding's grads).

A planner that counts a layer's FLOPs wrong, charges a collective the step does not run (or misses
one, or charges per step what runs per micro-batch), forgets the recomputed forward or mistakes
the bubble fails here, on a loaded machine as on a quiet one. What this does not check is the
rates of a real machine: the calibrated prediction against measured time (within 20% per
feature) and the ranking (the predicted best within 10% of the measured best) are
``tools/bench/bench_planner.py``'s figures, printed there with their spread over repetitions.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.simulator import Costs, simulate
from megalite.measure.comm_log import CommLog
from megalite.models.transformer import TransformerLayer
from megalite.planning.cluster import Cluster
from megalite.planning.predict import Layout
from megalite.planning.search import validate
from megalite.planning.step_time import predict_step_time
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tools.planner.accuracy import build_world_run

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --hidden-dropout 0 --attention-dropout 0 "
    "--attention-backend unfused --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--log-interval 1000 --eval-iters 0"
).split()
VOCAB, RATE, BYTES_PER_S = 256, 1e9, 1e6  # FLOP/s; the links are slow so that bytes count
CLUSTER = Cluster(
    gpus=2,
    gpus_per_node=2,
    gpu_memory_gib=64,
    peak_tflops=RATE / 1e12,
    efficiency=1.0,
    intra_node_gbps=BYTES_PER_S / 1e9,
    inter_node_gbps=BYTES_PER_S / 1e9,
    layer_overhead_s=1e-3,
    chunk_overhead_s=3e-3,
    step_overhead_s=0.0,
    collective_latency_s=0.0,
    reduce_scatter_cost=1.0,
    optimizer_s_per_param=0.0,  # the bytes per rank are test_memory_prediction's
    device="cpu",
)
FULL = ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
CASES = [  # (layout, extra model flags, global batch)
    (Layout(dp=2, micro_batch_size=2), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim"), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim_grads"), [], 8),
    (Layout(dp=2, micro_batch_size=2, rung="optim_grads_params"), [], 8),
    (Layout(dp=2, micro_batch_size=2, recompute="full"), FULL, 8),
    (Layout(tp=2, micro_batch_size=2), [], 4),
    (Layout(tp=2, micro_batch_size=2, sequence_parallel=True), [], 4),
    (Layout(tp=2, micro_batch_size=2, recompute="selective"), [], 4),
    (Layout(pp=2, micro_batch_size=1), [], 4),
    (Layout(pp=2, micro_batch_size=1, schedule="gpipe"), [], 4),
]


class StepCounter(TorchDispatchMode):
    """Matrix-multiply FLOPs of the ops run inside, forward and backward apart (an op runs in
    backward while autograd's engine runs a graph task), and the forward passes of ``layers``
    and ``chunks`` outside backward (a recomputed layer is the backward's work)."""

    def __init__(self, chunks: list, layers: list) -> None:
        super().__init__()
        self.flops = {"forward": 0, "backward": 0}
        self.passes = Counter()
        self.hooks = [m.register_forward_pre_hook(self._pass("layer")) for m in layers]
        self.hooks += [m.register_forward_pre_hook(self._pass("chunk")) for m in chunks]

    def _pass(self, kind: str):
        def count(module, args):
            if not _in_backward():
                self.passes[kind] += 1

        return count

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            phase = "backward" if _in_backward() else "forward"
            self.flops[phase] += formula(*args, **kwargs, out_val=out)
        return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _case(cases) -> list:
    """Per layout on this rank: (predicted seconds, FLOPs, passes, collectives and messages)."""
    torch.set_num_threads(1)
    step = make_forward_step(torch.device("cpu"))
    out = []
    for layout, extra, gbs in cases:
        cfg, argv = validate(MODEL, layout, vocab_size=VOCAB, global_batch_size=gbs, extra=extra)
        # the ZeRO rungs' --overlap-grad-reduce hides a reduction behind backward: a claim about
        # time, not work (bench_planner.py's), so both sides run and price it exposed
        argv = [a for a in argv if a != "--overlap-grad-reduce"]
        predicted = predict_step_time(
            cfg.model,
            layout,
            CLUSTER,
            global_batch_size=gbs,
            precision=cfg.model.precision_name,
            overlap_grad_reduce=False,
        )
        run, ps = build_world_run([*argv, "--train-iters", "4"])
        chunks = [chunk.module for chunk in run.trainer.model]
        layers = [m for ch in chunks for m in ch.modules() if isinstance(m, TransformerLayer)]
        try:
            run.trainer.step(step, run.train_iter)  # the first step allocates the optimizer
            counter = StepCounter(chunks, layers)
            with CommLog() as log, counter:
                run.trainer.step(step, run.train_iter)
            counter.remove()
        finally:
            ps.destroy()
        out.append((predicted.seconds, dict(counter.flops), dict(counter.passes), log.records))
    return out


def _price(records) -> float:
    return sum(CLUSTER.collective_seconds(op, nbytes, n, n) for op, n, nbytes in records)


def _priced_step(layout: Layout, gbs: int, ranks: list) -> float:
    """The step the counts of every rank add up to (module docstring)."""
    lo, co = CLUSTER.layer_overhead_s, CLUSTER.chunk_overhead_s

    def work(flops: dict, passes: dict, phase: str) -> float:
        per_pass = 1 if phase == "forward" else 2  # a layer's backward: twice its forward
        return flops[phase] / RATE + per_pass * lo * passes["layer"] + co * passes["chunk"]

    if layout.pp == 1:
        return max(
            work(f, p, "forward") + work(f, p, "backward") + _price(comms) for f, p, comms in ranks
        )
    m = gbs // (layout.micro_batch_size * layout.dp)
    stages = []
    for f, p, _ in ranks:  # one chunk per rank: rank r holds stage r
        backward = work(f, p, "backward") / m
        stages.append((work(f, p, "forward") / m, backward / 2, backward / 2))
    messages = {nbytes for ranks_comms in ranks for op, _, nbytes in ranks_comms[2] if op == "p2p"}
    (message,) = messages  # every activation and grad sent is one [s, b, h]
    pipeline = layout_of(layout.schedule, layout.pp, layout.vp)
    lists = with_p2p(generate(layout.schedule, pp_size=layout.pp, num_microbatches=m), pipeline)
    costs = Costs(stages=stages, p2p=CLUSTER.collective_seconds("p2p", message, 2, 2))
    outside = max(_price([r for r in comms if r[0] != "p2p"]) for _, _, comms in ranks)
    return simulate(lists, pipeline, costs).step_time + outside


@pytest.fixture(scope="module")
def counted():
    return run_distributed(_case, 2, CASES, timeout=600)


def test_predicted_step_is_the_counted_work_priced(counted):
    misses = []
    for i, (layout, _, gbs) in enumerate(CASES):
        ranks = [rank_results[i][1:] for rank_results in counted]
        predicted = counted[0][i][0]
        priced = _priced_step(layout, gbs, ranks)
        if abs(predicted / priced - 1) > 1e-4:
            misses.append(f"{layout.name()}: predicted {predicted:.6f} s, priced {priced:.6f} s")
    assert not misses, "; ".join(misses)


def test_the_counts_see_the_work(counted):
    """The counter is not vacuous: a step's backward counts twice its forward FLOPs (none
    recomputed), and each rank counts one pass per layer and micro-batch."""
    seconds, flops, passes, comms = counted[0][0]  # rank 0, DP 2 with m 2
    assert flops["backward"] == 2 * flops["forward"] > 0, flops
    assert passes == {"layer": 2 * 2, "chunk": 2}, passes  # 2 layers x m 2
    assert any(op == "all_reduce" for op, _, _ in comms) and seconds > 0
