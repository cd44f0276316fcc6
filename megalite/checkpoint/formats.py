"""Save and load in any checkpoint format: megalite's own, Megatron-LM's ``torch``, ``torch_dist``.

    save_checkpoint(save_dir, iteration, ckpt_format="torch_dist", model_chunks=[gpt], ...)
    loaded = load_checkpoint(load_dir, model_chunks=[gpt], ...)   # whatever format is there

The one place that chooses: ``--ckpt-format`` picks the writer (``saving`` for megalite's files,
``megatron.saving`` for Megatron's); a load reads the format it finds in the iteration directory
(``megatron.detect_format``). Both sides take and return the same pieces, so the caller never
asks which format it holds. This module sits above the native modules and the ``megatron``
subpackage; neither imports it.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.checkpoint import loading, saving
from megalite.checkpoint.chunks import check_chunks
from megalite.checkpoint.files import RELEASE, CheckpointError, iteration_dir, read_tracker
from megalite.checkpoint.loading import LoadedCheckpoint
from megalite.checkpoint.megatron.loading import detect_format, load_megatron_checkpoint
from megalite.checkpoint.megatron.saving import save_megatron_checkpoint
from megalite.core.parallel_state import ParallelState

CKPT_FORMATS = ("megalite", "torch", "torch_dist")  # --ckpt-format


def save_checkpoint(
    save_dir: str,
    iteration: int,
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
    ckpt_format: str = "megalite",
) -> str:
    """``saving.save_checkpoint`` (the arguments and the collective contract are its) in
    ``ckpt_format`` (``--ckpt-format``): ``"megalite"`` (its files), or Megatron-LM's ``"torch"``
    / ``"torch_dist"`` (``megatron.saving``, one model chunk per rank). Returns the iteration
    directory."""
    pieces = dict(
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
        keep_last_n=keep_last_n,
    )
    if ckpt_format == "megalite":
        return saving.save_checkpoint(save_dir, iteration, **pieces)
    return save_megatron_checkpoint(save_dir, iteration, ckpt_format, **pieces)


def load_checkpoint(
    load_dir: str,
    *,
    model_chunks: list[nn.Module],
    optimizer,
    scheduler,
    ps: ParallelState,
    seed: int,
    iteration: int | str | None = None,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    layer_ranges: list[tuple[int, int]] | None = None,
) -> LoadedCheckpoint | None:
    """``loading.load_checkpoint`` (the arguments and the result are its) of whichever format
    ``load_dir`` holds at ``iteration``: megalite's own files, or a checkpoint Megatron-LM wrote
    (``megatron.loading``; into one model chunk per rank)."""
    if load_dir and iteration is None:
        iteration = read_tracker(load_dir)
    fmt = None
    if load_dir and iteration is not None:
        fmt = detect_format(iteration_dir(load_dir, iteration))
    if fmt is None:  # megalite's files; also every refusal and the "no checkpoint yet" warning
        return loading.load_checkpoint(
            load_dir,
            model_chunks=model_chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            ps=ps,
            seed=seed,
            iteration=iteration,
            load_optim=load_optim,
            load_rng=load_rng,
            finetune=finetune,
            layer_ranges=layer_ranges,
        )
    chunks = check_chunks(model_chunks)
    iter_dir = iteration_dir(load_dir, iteration)
    if len(chunks) > 1:
        raise CheckpointError(
            f"{iter_dir} is a Megatron-LM checkpoint: it loads into one model chunk per rank; "
            f"this run holds {len(chunks)} (virtual stages / a V schedule): load it once without "
            "them, save with --ckpt-format megalite, then resume from that"
        )
    return load_megatron_checkpoint(
        iter_dir,
        fmt,
        iteration=iteration,
        module=chunks[0],
        optimizer=optimizer,
        scheduler=scheduler,
        ps=ps,
        seed=seed,
        load_optim=load_optim,
        finetune=finetune or iteration == RELEASE,
        load_rng=load_rng,
    )
