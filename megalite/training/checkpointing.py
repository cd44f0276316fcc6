"""Save and load training checkpoints in Megatron's layout (DESIGN §5), under any layout.

    save_checkpoint(trainer)            # every rank, at an iteration boundary
    loaded = load_checkpoint(trainer)   # every rank, before the data loaders are built
    ...build the loaders from trainer.result.consumed_train_samples...
    loaded.restore_rng(trainer)         # last, so that building the loaders draws nothing after it

What each rank writes (``checkpoint_files`` has the paths): the first DP rank of every (TP, PP)
coordinate writes ``model_optim_rng.pt`` = the model shard, the plain optimizer's state (fp32
masters and Adam moments, keyed by parameter name), the LR scheduler, iteration, consumed samples,
the run's flags, its layout, and every DP rank's RNG states (gathered over DP). Under ZeRO-1
every DP rank also writes its own range, ``distrib_optim_{dp:03d}.pt``. Each rank fsyncs its files;
after a world-wide all-reduce (everyone has written) rank 0 replaces the tracker atomically.

Loading: the same (TP, PP) layout reads its own shard directly (bitwise-exact resume: model,
optimizer, scheduler, loss scaler, data position, RNG). Another layout goes through the logical
form (``resharding.CheckpointReader``): full tensors by global name, cut for this rank; optimizer
state too, for the plain and the distributed optimizer alike. RNG states are restored only under
the same (TP, PP, DP) layout; otherwise the generators are re-seeded from ``--seed`` + iteration.

Save now, from anywhere at an iteration boundary (the exit-signal handler does): call
``save_checkpoint(trainer)`` on every rank; it is collective and returns when the checkpoint is
complete and the tracker names it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.core.tensor_parallel.mappings import group_size
from megalite.core.tensor_parallel.random import model_parallel_seed
from megalite.training.checkpoint_files import (
    MODEL_FILE,
    RELEASE,
    TRACKER_FILE,
    CheckpointError,
    distrib_optim_file,
    fsync_dir,
    iteration_dir,
    load_file,
    pause_for_test,
    read_tracker,
    remove_old_checkpoints,
    save_file,
    shard_dir,
    write_tracker,
)
from megalite.training.checkpoint_state import (
    capture_rng_state,
    check_model_compatible,
    config_record,
    load_optimizer_full_state,
    optimizer_full_state,
    restore_rng_state,
)
from megalite.training.resharding import CheckpointReader, reshard_model, reshard_optimizer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "exit_duration_reached",
    "load_checkpoint",
    "save_checkpoint",
]


def _is_distributed(optimizer) -> bool:
    return optimizer.is_sharded


def _world_sum(value: float, ps) -> float:
    """Sum over every rank (also a barrier); the value itself on a world of one."""
    if ps.world_size == 1 or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ps.device)
    dist.all_reduce(t)
    return float(t.item())


def _gather_over_dp(obj: object, ps) -> list:
    if group_size(ps.dp_group) == 1:
        return [obj]
    out = [None] * ps.dp_size
    dist.all_gather_object(out, obj, group=ps.dp_group)
    return out


def _layout(trainer) -> dict:
    cfg, ps, module = trainer.cfg, trainer.ps, trainer.model.module
    return {
        "tp_size": ps.tp_size,
        "pp_size": ps.pp_size,
        "dp_size": ps.dp_size,
        "tp_rank": ps.tp_rank,
        "pp_rank": ps.pp_rank,
        "layer_ranges": [list(r) for r in cfg.model.stage_layer_ranges(ps.pp_size)],
        "padded_vocab_size": module.padded_vocab_size,
        "distributed_optimizer": _is_distributed(trainer.optimizer),
    }


def save_checkpoint(trainer, iteration: int | None = None, *, save_dir: str | None = None) -> str:
    """Write the checkpoint of ``iteration`` (default: ``trainer.result.iteration``) under
    ``save_dir`` (default ``--save``); returns its directory.

    Collective over the world: every rank calls it at the same iteration boundary. ``trainer``
    is a ``pretrain.Trainer`` (anything with ``cfg``, ``ps``, ``device``, ``model`` (the DP
    wrapper, ``.module`` the GPTModel stage), ``optimizer``, ``scheduler``, ``result`` and
    ``rng_tracker``)."""
    cfg, ps, r = trainer.cfg, trainer.ps, trainer.result
    t = cfg.training
    save_dir = save_dir or t.save
    if not save_dir:
        raise CheckpointError("save_checkpoint needs a directory: pass --save DIR")
    iteration = r.iteration if iteration is None else int(iteration)
    started = time.perf_counter()
    iter_dir = iteration_dir(save_dir, iteration)
    if ps.rank() == 0 and os.path.isdir(iter_dir) and read_tracker(save_dir) != iteration:
        shutil.rmtree(iter_dir)  # an uncommitted save of this iteration (a crash): start clean
    _world_sum(0.0, ps)
    folder = shard_dir(iter_dir, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, pp_size=ps.pp_size)
    os.makedirs(folder, exist_ok=True)
    module, optimizer = trainer.model.module, trainer.optimizer
    save_optim = not getattr(t, "no_save_optim", False)
    written = 0
    if save_optim and _is_distributed(optimizer):
        path = os.path.join(folder, distrib_optim_file(ps.dp_rank))
        written += save_file(optimizer.sharded_state_dict(), path)
    rng = _gather_over_dp(capture_rng_state(trainer.rng_tracker, trainer.device), ps)
    if ps.dp_rank == 0:
        model_state = module.state_dict()
        if not save_optim:
            optim_state = None
        elif _is_distributed(optimizer):
            optim_state = {"distributed": True}
        else:
            optim_state = optimizer_full_state(optimizer)
        header = {
            "megalite_checkpoint": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_train_samples": r.consumed_train_samples,
            "consumed_valid_samples": getattr(r, "consumed_valid_samples", 0),
            "config": config_record(cfg),
            "layout": _layout(trainer),
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": trainer.scheduler.state_dict() if save_optim else None,
            "rng_state": rng,
        }
        written += save_file(header, os.path.join(folder, MODEL_FILE))
    if written:
        fsync_dir(folder)
        fsync_dir(iter_dir)
    pause_for_test(iteration)
    total = _world_sum(written, ps)  # every rank has written and fsynced its files
    if ps.rank() == 0:
        write_tracker(save_dir, iteration)
        keep = getattr(t, "keep_last_n_checkpoints", None)
        if keep:
            remove_old_checkpoints(save_dir, keep=keep, latest=iteration)
    _world_sum(0.0, ps)  # the tracker names this checkpoint on return, on every rank
    seconds = time.perf_counter() - started
    logger.info(
        "saved checkpoint at iteration %d to %s in %.2f s (%.1f MB, %.1f MB/s)",
        iteration, save_dir, seconds, total / 1e6, total / 1e6 / max(seconds, 1e-9),
    )  # fmt: skip
    trainer.last_saved_iteration = iteration
    return iter_dir


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` found; ``restore_rng`` applies its RNG states (or re-seeds)."""

    path: str
    iteration: int | str
    rng_state: dict | None  # this rank's, when the layout is unchanged and --no-load-rng is off
    reseed: int | None  # the seed to re-seed with when the RNG states cannot be restored

    def restore_rng(self, trainer) -> None:
        if self.rng_state is not None:
            restore_rng_state(self.rng_state, trainer.rng_tracker, trainer.device)
        elif self.reseed is not None:
            ps = trainer.ps
            fresh = model_parallel_seed(
                self.reseed, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, device=trainer.device
            )
            if trainer.rng_tracker is not None:
                trainer.rng_tracker.set_states(fresh.get_states())


def _full_from_distributed(files: list[dict], header: dict) -> dict:
    """The ZeRO-1 files of one (TP, PP) shard (every DP rank's range) -> the per-parameter form."""
    from megalite.core.optimizer import full_state_from_shards

    del header
    return full_state_from_shards(files)


def _load_model(module: torch.nn.Module, state: dict, where: str) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise CheckpointError(
            f"checkpoint {where} does not match this model stage: {name} is "
            f"{'missing from the checkpoint' if missing else 'not in this model'} "
            f"({len(missing)} missing, {len(unexpected)} unexpected); compare its flags"
        )
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"checkpoint {where}: {k} has shape {tuple(state[k].shape)} there but "
                f"{tuple(v.shape)} in this run; the model flags differ"
            )
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def _load_optimizer(trainer, reader: CheckpointReader, *, same_mp: bool) -> None:
    ps, opt, module = trainer.ps, trainer.optimizer, trainer.model.module
    if (
        same_mp
        and _is_distributed(opt)
        and reader.distributed_optimizer
        and reader.dp_size == ps.dp_size
    ):
        path = reader.path(ps.tp_rank, ps.pp_rank, distrib_optim_file(ps.dp_rank))
        try:
            opt.load_sharded_state_dict(load_file(path))
            return
        except ValueError as e:  # another bucket layout: go through the full form
            logger.info("%s; loading it through the full optimizer state instead", e)
    if same_mp:
        state = reader.optimizer_state(ps.tp_rank, ps.pp_rank)
    else:
        state = reshard_optimizer(
            reader,
            [n for n, _ in module.named_parameters()],
            layer_offset=module.layer_range[0],
            tp_size=ps.tp_size,
            tp_rank=ps.tp_rank,
            padded_vocab_size=module.padded_vocab_size,
        )
    load_optimizer_full_state(opt, state)


def _load_scheduler(trainer, saved: dict | None, iteration: int) -> None:
    scheduler = trainer.scheduler
    current = scheduler.state_dict()
    steps = int(saved["num_steps"]) if saved else iteration
    if saved:
        changed = [k for k in current if k != "num_steps" and saved.get(k) != current[k]]
        if changed:
            logger.warning(
                "the LR schedule of this run differs from the checkpoint's in %s; this run's is "
                "used from step %d on",
                ", ".join(f"{k} ({saved.get(k)} -> {current[k]})" for k in changed),
                steps,
            )
    scheduler.load_state_dict({**current, "num_steps": steps})


def load_checkpoint(
    trainer, *, load_dir: str | None = None, iteration: int | str | None = None
) -> LoadedCheckpoint | None:
    """Load ``--load`` (or ``load_dir``) at ``iteration`` (default ``--ckpt-step``, else the
    tracker's) into ``trainer``; None (and a warning) when there is no checkpoint there yet.

    Sets the model, the optimizer and scheduler (unless ``--no-load-optim`` / ``--finetune``),
    ``trainer.result.iteration`` and the consumed samples (unless ``--finetune``); returns the
    RNG states to apply once the data loaders are built (``LoadedCheckpoint.restore_rng``).
    Every rank calls it; it reads files only (no collective)."""
    cfg, ps, r = trainer.cfg, trainer.ps, trainer.result
    t = cfg.training
    load_dir = load_dir or t.load
    if not load_dir:
        raise CheckpointError("load_checkpoint needs a directory: pass --load DIR")
    if iteration is None:
        iteration = getattr(t, "ckpt_step", None)
    if iteration is None:
        iteration = read_tracker(load_dir)
    if iteration is None:
        logger.warning(
            "--load %s: no %s there, so no checkpoint is loaded; training from scratch",
            load_dir, TRACKER_FILE,
        )  # fmt: skip
        return None
    started = time.perf_counter()
    iter_dir = iteration_dir(load_dir, iteration)
    reader = CheckpointReader(iter_dir, full_distributed=_full_from_distributed)
    check_model_compatible(reader.model_config, cfg.model, where=iter_dir)
    module = trainer.model.module
    same_mp = (
        reader.tp_size == ps.tp_size
        and reader.layer_ranges == [tuple(x) for x in cfg.model.stage_layer_ranges(ps.pp_size)]
        and reader.meta["layout"]["padded_vocab_size"] == module.padded_vocab_size
    )
    if same_mp:
        own = reader.shard(ps.tp_rank, ps.pp_rank)
        _load_model(module, own["model"], iter_dir)
    else:
        state = reshard_model(
            reader,
            module.state_dict().keys(),
            layer_offset=module.layer_range[0],
            tp_size=ps.tp_size,
            tp_rank=ps.tp_rank,
            padded_vocab_size=module.padded_vocab_size,
        )
        _load_model(module, state, iter_dir)
    header = reader.meta
    finetune = getattr(t, "finetune", False) or iteration == RELEASE
    if not finetune:
        if not getattr(t, "no_load_optim", False):
            if not reader.has_optimizer():
                raise CheckpointError(
                    f"checkpoint {iter_dir} holds no optimizer state (saved with "
                    "--no-save-optim, or converted); pass --no-load-optim or --finetune"
                )
            _load_optimizer(trainer, reader, same_mp=same_mp)
        _load_scheduler(trainer, header.get("scheduler"), int(header["iteration"]))
        r.iteration = int(header["iteration"])
        r.consumed_train_samples = int(header["consumed_train_samples"])
        if hasattr(r, "consumed_valid_samples"):
            r.consumed_valid_samples = int(header.get("consumed_valid_samples", 0))
    rng_state, reseed = None, None
    if not finetune and not getattr(t, "no_load_rng", False):
        saved = reader.shard(ps.tp_rank, ps.pp_rank).get("rng_state") if same_mp else None
        if saved is not None and len(saved) == ps.dp_size:
            rng_state = saved[ps.dp_rank]
        else:
            reseed = t.seed + r.iteration
            logger.warning(
                "RNG states not restored: the checkpoint's layout TP %d x PP %d x DP %d differs "
                "from this run's; re-seeded with --seed + iteration = %d",
                reader.tp_size, reader.pp_size, reader.dp_size, reseed,
            )  # fmt: skip
    trainer.last_saved_iteration = r.iteration
    logger.info(
        "loaded checkpoint %s (TP %d x PP %d x DP %d%s) in %.2f s: iteration %d, %d samples "
        "consumed%s",
        iter_dir, reader.tp_size, reader.pp_size, reader.dp_size,
        "" if same_mp else f", resharded to TP {ps.tp_size} x PP {ps.pp_size}",
        time.perf_counter() - started, r.iteration, r.consumed_train_samples,
        " (--finetune: weights only)" if finetune else "",
    )  # fmt: skip
    return LoadedCheckpoint(iter_dir, iteration, rng_state, reseed)


def exit_duration_reached(trainer, started: float) -> bool:
    """``--exit-duration-in-mins``: whether the run has gone on longer than that since
    ``started`` (``time.time()``) on any rank (one all-reduce MAX, so every rank agrees)."""
    minutes = getattr(trainer.cfg.training, "exit_duration_in_mins", None)
    if not minutes:
        return False
    done = (time.time() - started) / 60.0 > minutes
    ps = trainer.ps
    if ps.world_size > 1 and dist.is_initialized():
        flag = torch.tensor([1.0 if done else 0.0], device=ps.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        done = flag.item() > 0
    return done
