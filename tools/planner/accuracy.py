"""The planner's step time against measurement, inside a CPU gloo world (every rank calls it).

    calibration, rows = step_time_accuracy(model_argv, layouts, vocab_size=256,
                                           global_batch_size=8)
    for row in rows: row.layout, row.predicted, row.measured, row.error

Calibrates the world first (``calibrate.calibrate_in_world``: the cores the ranks share, the
compute rate and fixed costs with every rank busy, the all-reduce), then for each layout predicts
the step (``search.evaluate`` on a ``Cluster`` of this machine) and runs it: ``steps`` timed steps
after one untimed (the first allocates the optimizer states); a step's time is the slowest rank's,
the figure the median over steps. ``tools/bench/bench_planner.py`` uses it (and
``tests/planning/test_step_time.py`` its ``build_world_run``). The collectives of the harness
itself (barriers, the slowest rank's time) go over the world group, named
(``calibrate_comm.world_group``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.planning.cluster import Cluster, calibrated
from megalite.planning.predict import Layout
from megalite.planning.search import evaluate
from megalite.planning.step_time import StepTime
from megalite.training.arguments import parse_args
from megalite.training.config import with_tokenizer
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import Run, build_run, mesh_for
from tools.planner.calibrate import REFERENCE, calibrate_in_world
from tools.planner.calibrate_comm import world_group

PEAK = 1.0  # TFLOP/s: on CPU the calibrated efficiency is then the achieved rate itself


@dataclass
class Row:
    layout: Layout
    predicted: float  # seconds per step
    measured: float  # median of the layout's steps
    step: StepTime | None = None  # the predicted step
    reference_predicted: float = 0.0  # the calibration's reference step, predicted
    reference_measured: float = 0.0  # ... and measured, each step beside one of the layout's
    paired_ratio: float = 0.0  # median over steps of (layout step / the reference step beside it)

    @property
    def raw_error(self) -> float:
        """Predicted over measured, less one, with the machine's speed as at calibration."""
        return self.predicted / self.measured - 1

    @property
    def error(self) -> float:
        """The error with the machine's speed of the moment: each of the layout's steps is timed
        beside a reference step (``measure_layout``), and the prediction is scaled by how much
        slower or faster that reference ran than it was predicted to (a shared machine's speed
        drifts 30-50% within a minute; the model's relative costs are what this checks)."""
        if not self.reference_measured:
            return self.raw_error
        return (self.predicted / self.reference_predicted) / self.paired_ratio - 1


def cpu_cluster(world: int, calibration: dict) -> Cluster:
    base = Cluster(
        gpus=world,
        gpus_per_node=world,
        gpu_memory_gib=64,
        peak_tflops=PEAK,
        intra_node_gbps=1.0,
        inter_node_gbps=1.0,
        device="cpu",
        name="cpu",
        reduce_scatter_cost=1.0,
    )
    return calibrated(base, {**calibration, "peak_tflops": PEAK})


def build_world_run(argv: list[str]) -> tuple[Run, ParallelState]:
    """pretrain_gpt.py's run of ``argv`` on every rank of the world (every rank calls it), on CPU,
    not resumed, with its own fresh mesh (``ParallelState.destroy`` it after)."""
    env = {"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())}
    cfg = with_tokenizer(parse_args(argv, env=env))
    ps = mesh_for(cfg.parallel)
    return build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False), ps


def build_single_run(argv: list[str]) -> Run:
    """pretrain_gpt.py's run of ``argv`` in this process alone (a mesh of one), on CPU."""
    cfg = with_tokenizer(parse_args(argv, env={}))
    device = torch.device("cpu")
    return build_run(cfg, ParallelState.single(device), device, seed_rng=True, resume=False)


def measure_layout(
    argv: list[str],
    *,
    steps: int,
    group: dist.ProcessGroup,
    reference: list[str] | None = None,
) -> tuple[float, float, float]:
    """(median step seconds, the reference's median, the median of their per-step ratio) of
    pretrain_gpt.py's ``argv`` on this world (a fresh ``ParallelState``, destroyed after); a step's
    time is the slowest rank's. With ``reference`` (model flags of a one-process run), each step
    comes right after a step of that run on every rank at once, which is how the calibration ran
    it: the pair sees the same machine. The first pair is untimed (it allocates the optimizer).
    ``group``: the world's, over which the harness lines the ranks up and takes the slowest."""
    step = make_forward_step(torch.device("cpu"))
    ref = build_single_run(reference) if reference else None
    run, ps = build_world_run(argv)
    try:
        times, ref_times = [], []
        for i in range(steps + 1):
            t_ref = 0.0
            if ref is not None:
                dist.barrier(group=group)
                start = time.perf_counter()
                ref.trainer.step(step, ref.train_iter)
                t_ref = time.perf_counter() - start
            dist.barrier(group=group)
            start = time.perf_counter()
            run.trainer.step(step, run.train_iter)
            t = torch.tensor([time.perf_counter() - start, t_ref])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if i:
                times.append(t[0].item())
                ref_times.append(t[1].item())
    finally:
        ps.destroy()
    if ref is None:
        return statistics.median(times), 0.0, 0.0
    ratio = statistics.median(a / b for a, b in zip(times, ref_times))
    return statistics.median(times), statistics.median(ref_times), ratio


def step_time_accuracy(
    model_argv: list[str],
    layouts: list[Layout | tuple[Layout, list[str]]],
    *,
    vocab_size: int,
    global_batch_size: int,
    steps: int = 3,
    reference: list[str] | None = None,
    calibration: dict | None = None,
    recalibrate: bool = False,
    quick_calibration: bool = False,
) -> tuple[dict, list[Row]]:
    """(the calibration, one ``Row`` per layout); a layout may come with extra model flags
    (``(layout, ["--num-experts", "4"])``); ``reference``: the calibration's model flags (default
    ``calibrate.REFERENCE``); ``recalibrate``: calibrate again before each layout (a loaded
    machine's speed drifts over seconds: each layout is held against the machine of its moment);
    ``quick_calibration``: one short round of each calibration measurement (a smoke run).
    Every rank of the world calls it."""
    torch.set_num_threads(1)
    group = world_group()
    world = dist.get_world_size(group)
    reference = list(reference or REFERENCE)
    if calibration is None:
        calibration = calibrate_in_world(reference, group=group, quick=quick_calibration)
    iters = ["--train-iters", str(steps + 2)]
    ref_argv = [*reference, "--micro-batch-size", "4", "--global-batch-size", "4", *iters]
    rows = []
    for i, item in enumerate(layouts):
        if recalibrate and i:
            calibration = calibrate_in_world(reference, group=group, quick=quick_calibration)
        cluster = cpu_cluster(world, calibration)
        lay, extra = item if isinstance(item, tuple) else (item, [])
        c = evaluate(
            model_argv,
            lay,
            cluster,
            vocab_size=vocab_size,
            global_batch_size=global_batch_size,
            extra=extra,
        )
        if c.error:
            raise ValueError(f"{lay.name()}: {c.error}")
        measured, ref_measured, ratio = measure_layout(
            [*c.argv, *iters], steps=steps, group=group, reference=ref_argv
        )
        row = Row(lay, c.step.seconds, measured, c.step)
        row.reference_predicted = reference_seconds(reference, cluster, world)
        row.reference_measured, row.paired_ratio = ref_measured, ratio
        rows.append(row)
    return calibration, rows


def reference_seconds(reference: list[str], cluster: Cluster, world: int) -> float:
    """The predicted step of the calibration's reference (micro-batch 4, one process) as
    ``measure_layout`` runs it: on every rank of the world at once, sharing the cores."""
    vocab = int(reference[reference.index("--vocab-size") + 1])
    k = reference.index("--vocab-size")
    model = reference[:k] + reference[k + 2 :]
    one = Layout(micro_batch_size=4)
    alone = replace(cluster, gpus=1, gpus_per_node=1)
    c = evaluate(model, one, alone, vocab_size=vocab, global_batch_size=4)
    if c.error:
        raise ValueError(f"the reference: {c.error}")
    return c.step.seconds * (world / cluster.cores if 0 < cluster.cores < world else 1.0)
