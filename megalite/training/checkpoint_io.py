"""The Trainer's side of checkpointing: ``megalite.checkpoint`` fed with the Trainer's pieces.

    save_checkpoint(trainer)            # every rank, at an iteration boundary (collective)
    loaded = load_checkpoint(trainer)   # every rank, before the data loaders are built
    ...build the loaders from trainer.result.consumed_train_samples...
    restore_rng(trainer, loaded)        # last, so that building the loaders draws nothing after

The flags (``--save``, ``--load``, ``--ckpt-step``, ``--no-save-optim``, ``--no-load-optim``,
``--no-load-rng``, ``--finetune``, ``--keep-last-n-checkpoints``, ``--seed``,
``--use-checkpoint-opt_param-scheduler``, ``--async-save``) are read here and passed to the
package as arguments; the run's ``PretrainConfig`` is recorded in every checkpoint
(``config_record``). Also ``exit_duration_reached`` (``--exit-duration-in-mins``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from megalite import checkpoint
from megalite.checkpoint import CheckpointError, LoadedCheckpoint
from megalite.checkpoint.async_save import AsyncCheckpointWriter
from megalite.checkpoint.files import iteration_dir
from megalite.checkpoint.megatron import scheduler_steps_from_samples
from megalite.checkpoint.megatron.loading import detect_format, open_reader
from megalite.checkpoint.records import plain_data
from megalite.checkpoint.saving import prepare_save
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.training.config import PretrainConfig
from megalite.training.lr_scheduler import DECAY_STYLES
from megalite.training.model_chunks import grad_wrappers, stage_blocks
from megalite.training.pipeline_config import effective_schedule, num_model_chunks

logger = logging.getLogger(__name__)


def gpt_modules(model: list[ModelChunk]) -> list[nn.Module]:
    """The GPT stage module of each model chunk. ``model``: the Trainer's model, a list of
    ``ModelChunk`` (one per virtual stage) whose ``.module`` is the GPTModel stage."""
    return [chunk.module for chunk in model]


def config_record(cfg: PretrainConfig) -> dict:
    """The run's ``PretrainConfig`` as plain data (each concern's dataclass), plus the
    tokenizer's vocabulary size and special ids under ``"tokenizer"``."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = plain_data(dataclasses.asdict(value))
    tokenizer = cfg.tokenizer
    if tokenizer is not None:
        eod = int(tokenizer.eod)
        bos = tokenizer.bos
        out["tokenizer"] = {
            "class": type(tokenizer).__name__,
            "vocab_size": int(tokenizer.vocab_size),
            "eod": eod,
            "bos": eod if bos is None else int(bos),
        }
    return out


def async_writer(cfg: PretrainConfig) -> AsyncCheckpointWriter | None:
    """``--async-save``: the run's background checkpoint writer (None without the flag). Megatron's
    formats (``--ckpt-format torch|torch_dist``) are written synchronously, said in one line."""
    t = cfg.training
    if not t.async_save:
        return None
    if t.ckpt_format != "megalite":
        logger.warning(
            "--async-save writes megalite's format only: --ckpt-format %s saves synchronously",
            t.ckpt_format,
        )
        return None
    return AsyncCheckpointWriter()


def save_checkpoint(
    trainer,
    iteration: int | None = None,
    *,
    save_dir: str | None = None,
    keep_last_n: int | None = None,
) -> str:
    """Write the checkpoint of ``iteration`` (default: ``trainer.result.iteration``) under
    ``save_dir`` (default ``--save``; ``keep_last_n`` default ``--keep-last-n-checkpoints``);
    returns its directory. Collective over the world.
    With ``--async-save`` (``trainer.async_writer``) the save in flight is committed first, this
    one is copied to host memory and written in the background (the next optimizer step waits
    for the copy: ``wait_for_async_copy``): it is committed by the next save or
    ``finish_async_save``.

    ``trainer``: a ``pretrain.Trainer`` (anything with ``cfg``, ``ps``, ``device``, ``model``,
    ``optimizer``, ``scheduler``, ``result``, ``rng_tracker`` and ``async_writer``)."""
    t, r = trainer.cfg.training, trainer.result
    iteration = r.iteration if iteration is None else int(iteration)
    finish_async_save(trainer)  # one snapshot in flight at most
    pieces = _pieces(trainer, t, r)
    if keep_last_n is not None:
        pieces["keep_last_n"] = keep_last_n
    with gathered_params(trainer.model):  # ZeRO-3: params whole while saving
        if trainer.async_writer is not None:
            pending = prepare_save(save_dir or t.save, iteration, defer_finite_check=True, **pieces)
            # ZeRO-3 releases the whole params on leaving ``gathered_params``: copied before
            keep = all(w.keeps_whole_params for w in grad_wrappers(trainer.model))
            trainer.async_writer.start(pending, device=trainer.device, wait_for_copy=not keep)
            iter_dir = pending.iter_dir
        else:
            iter_dir = checkpoint.save_checkpoint(
                save_dir or t.save, iteration, ckpt_format=t.ckpt_format, **pieces
            )
    trainer.last_saved_iteration = iteration
    return iter_dir


def wait_for_async_copy(trainer) -> None:
    """``--async-save``: wait until the save in flight has copied the state (a no-op without
    one); the training step calls it before the optimizer changes parameters and moments."""
    if trainer.async_writer is not None:
        trainer.async_writer.wait_for_copy()


def finish_async_save(trainer) -> str | None:
    """``--async-save``: wait for the save in flight and commit it (collective over the world:
    every rank at the same point; the next save, an exit signal's save and the end of training
    call it); returns its directory, or None when none was in flight."""
    writer = trainer.async_writer
    return None if writer is None else writer.finish()


NON_PERSISTENT_DIR = "non_persistent"  # Megatron's default folder under --save


def non_persistent_dir(t) -> str | None:
    """Where ``--non-persistent-save-interval`` saves (``--non-persistent-global-ckpt-dir``, else
    SAVE/non_persistent); None without the interval. ``t``: the run's TrainingConfig."""
    if not t.non_persistent_save_interval:
        return None
    return t.non_persistent_global_ckpt_dir or os.path.join(t.save, NON_PERSISTENT_DIR)


def non_persistent_due(trainer) -> bool:
    """Whether this iteration gets a non-persistent save (its interval divides it)."""
    n = trainer.cfg.training.non_persistent_save_interval
    return bool(n) and trainer.result.iteration % n == 0


def save_non_persistent(trainer) -> str:
    """Save this iteration into ``non_persistent_dir`` (only the newest kept there), as
    ``save_checkpoint`` does (collective; asynchronous with ``--async-save``). The run's last
    persistent save is unchanged: the end of training still saves to ``--save``."""
    t = trainer.cfg.training
    persistent = trainer.last_saved_iteration
    iter_dir = save_checkpoint(trainer, save_dir=non_persistent_dir(t), keep_last_n=1)
    trainer.last_saved_iteration = persistent
    return iter_dir


def newest_checkpoint_dir(t) -> str | None:
    """The folder a resume reads: ``--load`` or, when its tracker names a later iteration, the
    non-persistent folder (``non_persistent_dir``). A tracker names a complete checkpoint only
    (it is replaced once every rank's files are written), so either choice is whole."""
    local = non_persistent_dir(t)
    if not t.load or not local:
        return t.load
    persistent, recent = _tracked(t.load), _tracked(local)
    if recent is None or (persistent is not None and persistent >= recent):
        return t.load
    logger.info(
        "resuming from the non-persistent checkpoint of iteration %d in %s (--load %s: %s)",
        recent,
        local,
        t.load,
        "none" if persistent is None else f"iteration {persistent}",
    )
    return local


def _tracked(folder: str) -> int | None:
    """The iteration ``folder``'s tracker names; None without one (or "release")."""
    try:
        found = checkpoint.read_tracker(folder)
    except CheckpointError:
        return None
    return found if isinstance(found, int) else None


def gathered_params(model: list[ModelChunk]) -> contextlib.ExitStack:
    """Every chunk's parameters whole inside (ZeRO-3 gathers its shards and writes loads back);
    a no-op for the other data-parallel rungs. Chunks that share one grad wrapper (views of one
    rank's model) enter it once."""
    stack = contextlib.ExitStack()
    for wrapper in grad_wrappers(model):
        stack.enter_context(wrapper.gathered_params())
    return stack


def _pieces(trainer, t, r) -> dict:
    """The keyword arguments of ``checkpoint.save_checkpoint`` but the format."""
    return dict(
        model_chunks=gpt_modules(trainer.model),
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        ps=trainer.ps,
        rng_tracker=trainer.rng_tracker,
        device=trainer.device,
        consumed_train_samples=r.consumed_train_samples,
        consumed_valid_samples=r.consumed_valid_samples,
        config_record=config_record(trainer.cfg),
        save_optim=not t.no_save_optim,
        keep_last_n=t.keep_last_n_checkpoints,
    )


def load_checkpoint(
    trainer, *, load_dir: str | None = None, iteration: int | str | None = None
) -> LoadedCheckpoint | None:
    """Load ``--load`` (or ``load_dir``) at ``iteration`` (default ``--ckpt-step``, else the
    tracker's) into ``trainer``; None (and a warning) when there is no checkpoint there yet.

    Sets the model, the optimizer and scheduler (unless ``--no-load-optim`` / ``--finetune``),
    ``trainer.result.iteration`` and the consumed samples (unless ``--finetune``); returns the
    RNG states to apply once the data loaders are built (``restore_rng``). Every rank calls it."""
    t, r = trainer.cfg.training, trainer.result
    if load_dir is None and iteration is None and t.ckpt_step is None:
        load_dir = newest_checkpoint_dir(t)  # --load, or a newer non-persistent checkpoint
    if t.use_checkpoint_opt_param_scheduler and not t.finetune:
        schedule_from_checkpoint(
            trainer.scheduler, load_dir or t.load, t.ckpt_step if iteration is None else iteration
        )
    with gathered_params(trainer.model):  # ZeRO-3: loads into whole params
        loaded = _load(trainer, load_dir, iteration, t)
    if loaded is None:
        return None
    if loaded.progress is not None:
        r.iteration = loaded.progress.iteration
        r.consumed_train_samples = loaded.progress.consumed_train_samples
        r.consumed_valid_samples = loaded.progress.consumed_valid_samples
    trainer.last_saved_iteration = r.iteration
    return loaded


def saved_schedule(load_dir: str, iteration, samples_per_step: int) -> dict | None:
    """The LR schedule's settings (``LRScheduler.state_dict`` keys, position excluded) of the
    checkpoint at ``iteration`` (default: the tracker's) in any format; None when there is no
    checkpoint, or it holds no schedule. Megatron's (``OptimizerParamScheduler``, its older key
    names included) count warmup and decay in samples: divided by ``samples_per_step``."""
    if iteration is None:
        iteration = checkpoint.read_tracker(load_dir)
    if iteration is None or iteration == checkpoint.RELEASE:
        return None
    iter_dir = iteration_dir(load_dir, iteration)
    fmt = detect_format(iter_dir)
    if fmt is None:
        saved = checkpoint.CheckpointReader(iter_dir).meta.get("scheduler")
        return None if saved is None else {k: v for k, v in saved.items() if k != "num_steps"}
    saved = open_reader(iter_dir, fmt).meta.get("megatron_scheduler")
    if not saved:
        return None

    def first(*keys):
        return next(saved[k] for k in keys if k in saved)

    return {
        "max_lr": float(first("max_lr", "start_lr")),
        "min_lr": float(saved["min_lr"]),
        "warmup_iters": scheduler_steps_from_samples(
            first("lr_warmup_steps", "warmup_steps", "warmup_iter"), samples_per_step
        ),
        "decay_iters": scheduler_steps_from_samples(
            first("lr_decay_steps", "decay_steps", "end_iter"), samples_per_step
        ),
        "decay_style": first("lr_decay_style", "decay_style"),
    }


def schedule_from_checkpoint(scheduler, load_dir: str, iteration) -> None:
    """``--use-checkpoint-opt_param-scheduler``: ``scheduler`` takes the checkpoint's settings
    (rates, warmup and decay lengths, decay style) before the load sets its position, as Megatron
    takes them and ignores the flags'. One line logs them."""
    saved = saved_schedule(load_dir, iteration, scheduler.samples_per_step)
    if saved is None:
        return
    if saved["decay_style"] not in DECAY_STYLES:
        raise CheckpointError(
            f"--use-checkpoint-opt_param-scheduler: the checkpoint's --lr-decay-style "
            f"{saved['decay_style']} is not one megalite implements ({', '.join(DECAY_STYLES)})"
        )
    scheduler.load_state_dict({**scheduler.state_dict(), **saved})
    logger.info(
        "--use-checkpoint-opt_param-scheduler: the LR schedule of the checkpoint: --lr %g, "
        "--min-lr %g, warmup %g and decay %g iterations, %s",
        saved["max_lr"],
        saved["min_lr"],
        saved["warmup_iters"],
        saved["decay_iters"],
        saved["decay_style"],
    )


def _load(trainer, load_dir, iteration, t):
    return checkpoint.load_checkpoint(
        load_dir or t.load,
        model_chunks=gpt_modules(trainer.model),
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        ps=trainer.ps,
        seed=trainer.cfg.model.seed,
        iteration=t.ckpt_step if iteration is None else iteration,
        load_optim=not t.no_load_optim,
        load_rng=not t.no_load_rng,
        finetune=t.finetune,
        layer_ranges=run_layer_ranges(trainer),
    )


def run_layer_ranges(trainer) -> list[tuple[int, int]]:
    """The layers of every global stage of the trainer's run (stage order), for any number of
    model chunks per rank."""
    cfg = trainer.cfg
    layout = layout_of(
        effective_schedule(cfg), cfg.parallel.pipeline_model_parallel_size, num_model_chunks(cfg)
    )
    return stage_blocks(cfg.model, layout)


def restore_rng(trainer, loaded: LoadedCheckpoint) -> None:
    """Apply ``loaded``'s RNG states to the trainer's generators (or re-seed them)."""
    loaded.restore_rng(trainer.rng_tracker, ps=trainer.ps, device=trainer.device)


def exit_duration_reached(trainer, started: float) -> bool:
    """``--exit-duration-in-mins``: whether the run has gone on longer than that since
    ``started`` (``time.time()``) on any rank (one all-reduce MAX over ``ps.group()``, so every
    rank agrees)."""
    minutes = trainer.cfg.training.exit_duration_in_mins
    if not minutes:
        return False
    done = (time.time() - started) / 60.0 > minutes
    ps = trainer.ps
    if ps.size() > 1 and dist.is_initialized():
        flag = torch.tensor([1.0 if done else 0.0], device=ps.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ps.group())
        done = flag.item() > 0
    return done
