"""The pretraining job: the run assembled from a config and a mesh, then the loop.

    cfg = parse_args(argv)        # megalite.training.arguments
    result = pretrain(cfg)

``pretrain`` joins the process group the launcher set up (torchrun, srun or a plain process),
builds the mesh, refuses a config parsed for another world, then ``build_run`` assembles the model
chunks, the optimizer, a resumed checkpoint and the data loaders, and ``Trainer.train`` runs
``train_iters`` iterations (``megalite.training.trainer``), with a last evaluation on the
validation and test sets. Tests call ``build_run`` on their own mesh instead of copying this.

What watches the first step comes in as ``first_step_hooks`` (``trainer.FirstStepHook``): the
memory report measured after the first update is training's own (``log=True``);
``pretrain_gpt.py`` adds the planner's comparison.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.checkpoint import CheckpointError
from megalite.core.distributed import Zero3DataParallel
from megalite.core.groups import group_size
from megalite.core.optimizer import ShardedOptimizer
from megalite.core.optimizer.memory_report import log_memory_after_step, log_model_state_memory
from megalite.core.parallel_state import ParallelState, initialize_model_parallel
from megalite.core.tensor_parallel.random import model_parallel_seed
from megalite.data.builders import build_data_loaders, train_valid_test_num_samples
from megalite.training import checkpoint_io
from megalite.training.config import PretrainConfig, with_tokenizer
from megalite.training.determinism import deterministic_mode
from megalite.training.forward_step import make_forward_step
from megalite.training.hang_watch import start_hang_watch, stop_hang_watch
from megalite.training.launch import (
    LaunchInfo,
    detect_launch,
    init_distributed,
    select_device,
)
from megalite.training.logging import configure_logging
from megalite.training.model_chunks import ModelChunk, grad_wrappers
from megalite.training.signals import ExitSignalHandler, parse_signal
from megalite.training.startup_checks import check_startup
from megalite.training.trainer import FirstStepHook, Trainer, TrainingError, TrainResult

__all__ = [
    "FirstStepHook",
    "MemoryReport",
    "Run",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "build_run",
    "pretrain",
]

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """A run ready to train: the Trainer (model chunks, optimizer, scheduler, resumed state) and
    this rank's data iterators (one per model chunk; None where a split is empty)."""

    trainer: Trainer
    train_iter: list[Iterator | None]
    valid_iter: list[Iterator | None] | None
    test_iter: list[Iterator | None] | None


class MemoryReport(FirstStepHook):
    """The model-state memory measured after the first update, per rank, beside the theory
    (``memory_report.log_memory_after_step``: every rank, a collective; printed on the logging
    rank). The first step's own buffers (staged grad buckets, gathered ZeRO-3 units) are in it."""

    def after_first_update(self, trainer: Trainer) -> None:
        wrapper = grad_wrappers(trainer.model)[0]  # the chunks of a rank share one
        log_memory_after_step(wrapper, trainer.optimizer, trainer.ps)


def _barrier(group) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def build_run(
    cfg: PretrainConfig,
    ps: ParallelState,
    device: torch.device,
    *,
    seed_rng: bool = True,
    resume: bool = True,
    build_cache: bool = True,
    log: bool = False,
    first_step_hooks: Sequence[FirstStepHook] = (),
) -> Run:
    """Model chunks, optimizer, LR schedule, the checkpoint of ``--load`` (if any) and the data
    loaders positioned after it, on the mesh ``ps`` (any layout; ``ParallelState.single()`` for a
    single-process oracle). ``cfg`` must carry its tokenizer (``with_tokenizer``).
    ``seed_rng``: seed the TP-aware RNG tracker from ``--seed`` (dropout); ``resume``: load
    ``--load`` (if set; tests that drive the loading themselves pass False); ``build_cache``: this
    rank builds missing data index caches (one per node); ``log``: log the parameter count and
    the model-state memory, and measure it again after the first update (``MemoryReport``);
    ``first_step_hooks``: the trainer's (after the memory report). Every rank of ``ps`` calls
    this."""
    tracker = None
    if seed_rng:
        tracker = model_parallel_seed(
            cfg.model.seed, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, device=device
        )
    hooks = [MemoryReport(), *first_step_hooks] if log else list(first_step_hooks)
    trainer = Trainer(cfg, ps, device=device, tracker=tracker, first_step_hooks=hooks)
    if log:
        n_params = sum(p.numel() for chunk in trainer.model for p in chunk.module.parameters())
        logger.info("parameters on the last rank: %d", n_params)
        wrapper = grad_wrappers(trainer.model)[0]  # the chunks of a rank share one
        log_model_state_memory(wrapper, trainer.optimizer, ps)
    t = cfg.training
    try:
        loaded = checkpoint_io.load_checkpoint(trainer) if t.load and resume else None
    except CheckpointError as e:  # one line for pretrain_gpt.py to print
        raise TrainingError(str(e)) from None
    samples = train_valid_test_num_samples(
        train_iters=t.train_iters,
        global_batch_size=t.global_batch_size,
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
    )
    # a batch-size ramp: Megatron's sampler, sized by --train-samples
    ramp = not trainer.batch_sizes.constant
    if ramp:
        needed = trainer.batch_sizes.consumed_after(t.train_iters)  # may pass --train-samples
        samples = (max(t.train_samples or samples[0], needed), *samples[1:])
    iters = build_data_loaders(
        cfg.data,
        seq_length=cfg.model.seq_length,
        seed=cfg.model.seed,
        tokenizer=cfg.tokenizer,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=ps.dp_rank,  # the cp ranks of a replica read the same micro-batches
        dp_size=ps.dp_size,
        train_samples=samples[0],
        valid_samples=samples[1],
        test_samples=samples[2],
        consumed_train_samples=trainer.result.consumed_train_samples,
        consumed_valid_samples=trainer.result.consumed_valid_samples,
        device=device,
        build_cache=build_cache,
        barrier=lambda: _barrier(ps.group()),
        train_global_batch_size=t.micro_batch_size * ps.dp_size if ramp else None,
    )
    if loaded is not None:  # last: building the loaders may draw from the generators
        checkpoint_io.restore_rng(trainer, loaded)
    chunks = len(trainer.model)  # every chunk of a rank reads the same micro-batches
    train, valid, test = ([it] * chunks if it is not None else None for it in iters)
    return Run(trainer, train, valid, test)


def end_of_run(model: list[ModelChunk], optimizer) -> None:
    """The end of a run: delete the offload files it created (the optimizer's state files, then
    ZeRO-3's param and grad files, with the directories they made when left empty), and remove
    the grad hooks, whose cycle through C++ would keep the model and its groups alive.
    Checkpoints are elsewhere and stay."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.remove_offload_files()
    for wrapper in grad_wrappers(model):
        if isinstance(wrapper, Zero3DataParallel):
            wrapper.remove_offload_files()
        wrapper.remove_hooks()


def _exit_signal_handler(cfg: PretrainConfig) -> ExitSignalHandler | None:
    """The installed handler when ``--exit-signal-handler`` is on, else None."""
    t = cfg.training
    if not t.exit_signal_handler:
        return None
    handler = ExitSignalHandler(parse_signal(t.exit_signal)).install()
    logger.info("--exit-signal-handler: %s saves a checkpoint and exits", handler.signum.name)
    return handler


def mesh_for(par, **kwargs) -> ParallelState:
    """The process groups of a run's parallel config (``cfg.parallel``): tp (with its mode's
    grid), pp, cp and the expert view, in its rank order; ``kwargs`` (device, timeout) pass to
    ``initialize_model_parallel``."""
    kwargs.setdefault("order", par.rank_order)
    return initialize_model_parallel(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        context_parallel_size=par.context_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        tensor_parallel_mode=par.tensor_parallel_mode,
        tensor_parallel_depth=par.tensor_parallel_depth,
        **kwargs,
    )


def pretrain(
    cfg: PretrainConfig,
    *,
    forward_step_func: Callable | None = None,
    env=None,
    first_step_hooks: Sequence[FirstStepHook] = (),
) -> TrainResult:
    """Run the whole job described by ``cfg``; returns the summary (losses on the last stage).
    ``first_step_hooks`` watch the first training step (``FirstStepHook``), after the memory
    report."""
    cfg = with_tokenizer(cfg)  # validates; builds the tokenizer unless set
    launch = detect_launch(env)
    check_startup(cfg, launch)  # flags and files, before any process group
    # before the first process group and cuBLAS handle, which read the environment it sets
    with deterministic_mode(cfg.training.deterministic_mode):
        result = _pretrain(cfg, launch, forward_step_func, first_step_hooks)
    # The run's model, optimizer and process groups are free now; what reference cycles still
    # hold goes here, not at interpreter exit. Each gloo group's destructor joins its worker
    # threads (the GIL released), and a worker may still hold the last reference to a finished
    # collective's tensor, whose release takes the GIL: during interpreter shutdown Python 3.11
    # ends such a thread inside a noexcept C++ destructor, and the process aborts
    # (``terminate called without an active exception``) after a run that succeeded.
    gc.collect()
    return result


def _pretrain(
    cfg: PretrainConfig,
    launch: LaunchInfo,
    forward_step_func: Callable | None,
    first_step_hooks: Sequence[FirstStepHook],
) -> TrainResult:
    device = select_device(cfg.parallel.device, launch.local_rank)
    owns_world = not dist.is_initialized()
    init_distributed(launch, device, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    try:
        ps = mesh_for(
            cfg.parallel,
            device=device,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )
    except BaseException:  # a refused mesh leaves no world behind for the caller
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()
        raise
    configure_logging(rank=ps.rank(), log_rank=ps.world_size - 1)
    trainer = None
    exit_signal = None
    hang_watch = start_hang_watch(cfg.parallel, ps)
    try:
        num_microbatches = cfg.check_world(ps.world_size, ps.dp_size)  # before any data is read
        exit_signal = _exit_signal_handler(cfg)
        cp = f" x CP {ps.cp_size} ({cfg.model.cp_comm_type})" if ps.cp_size > 1 else ""
        logger.info(
            "megalite: world %d = TP %d%s x PP %d x DP %d on %s (%s), %d micro-batches of %d per "
            "DP rank per iteration",
            ps.world_size,
            ps.tp_size,
            cp,
            ps.pp_size,
            ps.dp_size,
            device,
            ps.backend,
            num_microbatches,
            cfg.training.micro_batch_size,
        )
        logger.info(cfg.parallel.grad_dtype_line(cfg.model.precision_name))
        if cfg.training.deterministic_mode:
            logger.info(
                "--deterministic-mode: torch deterministic algorithms, NCCL_ALGO=%s, "
                "CUBLAS_WORKSPACE_CONFIG=%s",
                os.environ["NCCL_ALGO"],
                os.environ["CUBLAS_WORKSPACE_CONFIG"],
            )
        run = build_run(
            cfg,
            ps,
            device,
            build_cache=launch.local_rank == 0,
            log=True,
            first_step_hooks=first_step_hooks,
        )
        trainer, t = run.trainer, cfg.training
        trainer.exit_signal = exit_signal
        forward_step = forward_step_func or make_forward_step(
            device, calculate_per_token_loss=cfg.training.calculate_per_token_loss
        )
        valid_iter = run.valid_iter if t.eval_iters else None
        result = trainer.train(forward_step, run.train_iter, valid_iter)
        if t.eval_iters > 0 and not result.exited_on_signal:
            prefix = f"iteration {result.iteration}"
            if run.valid_iter is not None:
                result.validation = trainer.evaluate(
                    forward_step, run.valid_iter, f"{prefix} on validation set"
                )
            if run.test_iter is not None:
                result.test = trainer.evaluate(forward_step, run.test_iter, f"{prefix} on test set")
        logger.info("training done: %d iterations", result.iteration)
        return result
    except BaseException as exc:
        if hang_watch is not None:  # a failed collective: explain every rank's state, exit
            hang_watch.on_error(exc)
        raise
    finally:
        stop_hang_watch(hang_watch)
        if exit_signal is not None:
            exit_signal.restore()
        if trainer is not None:
            trainer.tensorboard.close()
            if trainer.stragglers is not None:
                trainer.stragglers.close()
            end_of_run(trainer.model, trainer.optimizer)
        ps.destroy()
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()
