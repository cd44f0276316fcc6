"""Save in Megatron-LM's ``torch`` / ``torch_dist`` format (``--ckpt-format``), training or offline.

    save_megatron_checkpoint(save_dir, iteration, "torch_dist", model_chunks=[gpt], ...)
    convert_to_megatron(src_iter_dir, dst_iter_dir, fmt)   # offline, one process

In training the ranks first write megalite's own files into ``SAVE/.megalite_staging`` (the usual
collective save, ``checkpoint.saving``), then rank 0 converts that iteration into ``SAVE/iter_N`` in
Megatron's format through the logical form (``resharding.CheckpointReader``; ``writing``), replaces
the tracker and deletes the staging copy. The conversion reads the whole model on rank 0: simple
and exact, not a parallel write; megalite's own format (the default) remains the fast path.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from megalite.checkpoint.files import (
    RELEASE,
    CheckpointError,
    fsync_dir,
    iteration_dir,
    remove_old_checkpoints,
    write_tracker,
)
from megalite.checkpoint.megatron.writing import write_dist, write_legacy
from megalite.checkpoint.resharding import CheckpointReader
from megalite.checkpoint.saving import save_checkpoint, world_sum
from megalite.core.parallel_state import ParallelState

STAGING = ".megalite_staging"


def megatron_format_refusal(tp_mode: str, fmt: str) -> str:
    """Why Megatron's formats are not written from a grid tensor-parallel mode, and the fix."""
    return (
        f"tensor_parallel_mode {tp_mode} does not combine with ckpt_format {fmt} (Megatron's "
        "formats hold 1d tensor-parallel shards); use ckpt_format megalite (the default), "
        "which loads under any mode and layout and exports to HF"
    )


def staging_dir(save_dir: str) -> str:
    """Where the ranks write megalite's files before rank 0 converts them."""
    return os.path.join(save_dir, STAGING)


def convert_to_megatron(src_iter_dir: str, dst_iter_dir: str, fmt: str) -> None:
    """One megalite iteration directory -> the same checkpoint in Megatron's ``fmt``."""
    if fmt not in ("torch", "torch_dist"):
        raise CheckpointError(f"--ckpt-format {fmt!r}: choose megalite, torch or torch_dist")
    reader = CheckpointReader(src_iter_dir)
    if reader.tp_mode != "1d":
        raise CheckpointError(f"{src_iter_dir}: {megatron_format_refusal(reader.tp_mode, fmt)}")
    if os.path.isdir(dst_iter_dir):
        shutil.rmtree(dst_iter_dir)
    os.makedirs(dst_iter_dir)
    if fmt == "torch":
        write_legacy(reader, dst_iter_dir)
    else:
        write_dist(reader, dst_iter_dir)


def finish_megatron_save(save_dir: str, iteration: int | str, fmt: str) -> str:
    """Rank 0, after the collective save into ``staging_dir(save_dir)``: convert, replace the
    tracker, delete the staging copy. Returns the Megatron iteration directory."""
    staged = iteration_dir(staging_dir(save_dir), iteration)
    dst = iteration_dir(save_dir, iteration)
    convert_to_megatron(staged, dst, fmt)
    fsync_dir(save_dir)
    write_tracker(save_dir, RELEASE if iteration == RELEASE else int(iteration))
    shutil.rmtree(staging_dir(save_dir), ignore_errors=True)
    return dst


def save_megatron_checkpoint(
    save_dir: str,
    iteration: int,
    fmt: str,
    *,
    model_chunks: list[nn.Module],
    optimizer,
    scheduler,
    ps: ParallelState,
    rng_tracker,
    device: torch.device,
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    config_record: dict | None = None,
    save_optim: bool = True,
    keep_last_n: int | None = None,
) -> str:
    """Write the checkpoint of ``iteration`` under ``save_dir`` in Megatron's ``fmt`` (``"torch"``
    or ``"torch_dist"``); returns its directory. The arguments are ``saving.save_checkpoint``'s;
    one model chunk per rank. Collective over the world, as that save is: every rank writes its
    part of the staged copy, rank 0 converts it, and every rank returns once the tracker names
    the converted checkpoint."""
    if not save_dir:
        raise CheckpointError("save_checkpoint needs a directory: pass --save DIR")
    if ps.sizes.tp_mode != "1d":  # on every rank, before any collective
        raise CheckpointError(megatron_format_refusal(ps.sizes.tp_mode, fmt))
    if len(model_chunks) > 1:
        raise CheckpointError(
            f"--ckpt-format {fmt} with {len(model_chunks)} model chunks per rank "
            "(virtual stages / a V schedule) is not written yet: save with --ckpt-format "
            "megalite (it reshards into any layout) and convert from a one-chunk-per-rank run"
        )
    save_checkpoint(
        staging_dir(save_dir),
        iteration,
        model_chunks=model_chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        ps=ps,
        rng_tracker=rng_tracker,
        device=device,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples,
        config_record=config_record,
        save_optim=save_optim,
    )
    if ps.rank() == 0:
        finish_megatron_save(save_dir, iteration, fmt)
        if keep_last_n:
            remove_old_checkpoints(save_dir, keep=keep_last_n, latest=int(iteration))
    world_sum(0.0, ps)  # every rank returns once the tracker names the converted checkpoint
    return iteration_dir(save_dir, iteration)
