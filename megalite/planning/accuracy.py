"""The planner's step time against measurement, inside a CPU gloo world (every rank calls it).

    rows = step_time_accuracy(model_argv, layouts, vocab_size=256, global_batch_size=8)
    for layout, predicted, measured in rows: ...

Calibrates the world first (``calibrate.calibrate_in_world``: the cores the ranks share, the
compute rate and fixed costs with every rank busy, the all-reduce), then for each layout predicts
the step (``search.evaluate`` on a ``Cluster`` of this machine) and runs it: ``steps`` timed steps
after one untimed (the first allocates the optimizer states); a step's time is the slowest rank's,
the figure the median over steps. ``tests/planning/test_step_time.py`` and
``tools/bench/bench_planner.py`` use it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from megalite.planning.cluster import Cluster, calibrated
from megalite.planning.predict import Layout

PEAK = 1.0  # TFLOP/s: on CPU the calibrated efficiency is then the achieved rate itself


@dataclass
class Row:
    layout: Layout
    predicted: float  # seconds per step
    measured: float
    step: object = None  # the predicted StepTime

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def cpu_cluster(world: int, calibration: dict) -> Cluster:
    base = Cluster(gpus=world, gpus_per_node=world, gpu_memory_gib=64, peak_tflops=PEAK,
                   intra_node_gbps=1.0, inter_node_gbps=1.0, device="cpu", name="cpu",
                   reduce_scatter_cost=1.0)  # fmt: skip
    return calibrated(base, {**calibration, "peak_tflops": PEAK})


def measure_layout(argv: list[str], *, steps: int) -> float:
    """Median over ``steps`` steps of the slowest rank's step seconds, of pretrain_gpt.py's
    ``argv`` on this world (a fresh ``ParallelState``, destroyed after)."""
    import torch.distributed as dist

    from megalite.training.arguments import parse_args
    from megalite.training.config import with_tokenizer
    from megalite.training.forward_step import make_forward_step
    from megalite.training.pretrain import build_run, mesh_for

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = with_tokenizer(parse_args(argv, env={"WORLD_SIZE": str(world), "RANK": str(rank)}))
    ps = mesh_for(cfg.parallel)
    try:
        run = build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False)
        step = make_forward_step(torch.device("cpu"))
        times = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            run.trainer.step(step, run.train_iter)
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                times.append(t.item())
    finally:
        ps.destroy()
    return statistics.median(times)


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
) -> tuple[dict, list[Row]]:
    """(the calibration, one ``Row`` per layout); a layout may come with extra model flags
    (``(layout, ["--num-experts", "4"])``); ``reference``: the calibration's model flags (default
    ``calibrate.REFERENCE``); ``recalibrate``: calibrate again before each layout (a loaded
    machine's speed drifts over seconds: each layout is held against the machine of its moment)."""
    import torch.distributed as dist

    from megalite.planning.calibrate import REFERENCE, calibrate_in_world
    from megalite.planning.search import evaluate

    torch.set_num_threads(1)
    if calibration is None:
        calibration = calibrate_in_world(reference or REFERENCE)
    rows = []
    for i, item in enumerate(layouts):
        if recalibrate and i:
            calibration = calibrate_in_world(reference or REFERENCE)
        cluster = cpu_cluster(dist.get_world_size(), calibration)
        lay, extra = item if isinstance(item, tuple) else (item, [])
        c = evaluate(model_argv, lay, cluster, vocab_size=vocab_size,
                     global_batch_size=global_batch_size, extra=extra)  # fmt: skip
        if c.error:
            raise ValueError(f"{lay.name()}: {c.error}")
        measured = measure_layout([*c.argv, "--train-iters", str(steps + 2)], steps=steps)
        rows.append(Row(lay, c.step.seconds, measured, c.step))
    return calibration, rows
