"""Load a checkpoint Megatron-LM wrote (``torch`` or ``torch_dist``) at any layout (DESIGN §5).

    fmt = detect_format(iter_dir)          # "torch" (legacy), "torch_dist", or None (megalite's)
    loaded = load_megatron_checkpoint(iter_dir, fmt, iteration=..., module=gpt, ...)

Both formats are served as megalite's logical form by a ``MegatronReader`` (``readers``,
``dist``); the load then goes through the same resharding as a megalite checkpoint of another
layout: model, Adam state (fp32 masters, moments, step), scheduler position, iteration and consumed
samples. Megatron's model settings (``args``) are checked against this run's as a megalite
checkpoint's are, and its math flags must equal this run's. The scheduler position is Megatron's
``num_steps`` in samples, converted to megalite's final-size global batches (``states``).
Megatron's RNG states are restored when the layout matches (same TP and PP); otherwise the run is
re-seeded from ``--seed`` + iteration with one warning, as after a reshard. Refused with one line:
expert or virtual pipeline parallel checkpoints.
"""

from __future__ import annotations

import json
import logging
import os

from torch import nn

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.loading import LoadedCheckpoint, Progress, load_model_state
from megalite.checkpoint.megatron.args import arg, check_math_flags
from megalite.checkpoint.megatron.dist import DistReader
from megalite.checkpoint.megatron.legacy import find_megatron_shard
from megalite.checkpoint.megatron.readers import LegacyReader, MegatronReader
from megalite.checkpoint.megatron.states import (
    rng_state_from_megatron,
    scheduler_steps_from_samples,
)
from megalite.checkpoint.records import check_model_compatible
from megalite.checkpoint.resharding import reshard_model, reshard_optimizer
from megalite.checkpoint.tp_shards import TPLayout
from megalite.core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def detect_format(iter_dir: str) -> str | None:
    """``"torch_dist"`` (a ``metadata.json`` naming a sharded backend), ``"torch"`` (a Megatron
    ``model_optim_rng.pt``), or None (megalite's own files, or nothing there)."""
    meta = os.path.join(iter_dir, "metadata.json")
    if os.path.isfile(meta):
        with open(meta, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(
                f"{meta}: Megatron's sharded backend {backend!r} is not read (only torch_dist); "
                "convert it with Megatron's checkpoint converter to torch_dist or torch"
            )
        return "torch_dist"
    return "torch" if find_megatron_shard(iter_dir) else None


def open_reader(iter_dir: str, fmt: str) -> MegatronReader:
    """The reader of a Megatron iteration directory in format ``fmt`` (``detect_format``)."""
    if fmt == "torch":
        return LegacyReader(iter_dir)
    return DistReader(iter_dir)


def load_megatron_checkpoint(
    iter_dir: str,
    fmt: str,
    *,
    iteration: int | str,
    module: nn.Module,
    optimizer,
    scheduler,
    ps: ParallelState,
    seed: int,
    load_optim: bool,
    finetune: bool,
    load_rng: bool = True,
) -> LoadedCheckpoint:
    """Load a Megatron checkpoint into this rank's stage ``module`` (any layout; module doc).

    ``iteration``: the directory's (an int, or "release"). Sets the model and, unless
    ``finetune``, the scheduler and (``load_optim``) the optimizer; returns what
    ``loading.load_checkpoint`` returns for megalite's own files."""
    meta, rng_state, reseed, reader = _load_state(
        iter_dir,
        fmt,
        module=module,
        optimizer=optimizer,
        scheduler=scheduler,
        ps=ps,
        seed=seed,
        load_optim=load_optim,
        finetune=finetune,
        load_rng=load_rng,
    )
    progress = None
    if meta is not None:
        progress = Progress(
            iteration=int(meta["iteration"]),
            consumed_train_samples=int(meta["consumed_train_samples"]),
            consumed_valid_samples=int(meta["consumed_valid_samples"]),
        )
    saved_layout = f"TP {reader.tp_size} x PP {reader.pp_size}"
    logger.info(
        "loaded Megatron-LM checkpoint %s (%s format, %s) into TP %d x PP %d: "
        "iteration %d, %d samples consumed%s",
        iter_dir,
        fmt,
        saved_layout,
        ps.tp_size,
        ps.pp_size,
        progress.iteration if progress else 0,
        progress.consumed_train_samples if progress else 0,
        " (--finetune: weights only)" if progress is None else "",
    )
    return LoadedCheckpoint(iter_dir, iteration, progress, rng_state, reseed)


def _load_state(
    iter_dir: str,
    fmt: str,
    *,
    module: nn.Module,
    optimizer,
    scheduler,
    ps: ParallelState,
    seed: int,
    load_optim: bool,
    finetune: bool,
    load_rng: bool,
) -> tuple[dict | None, dict | None, int | None, MegatronReader]:
    """Set the pieces; returns (the reader's counters or None under ``finetune``, this rank's
    RNG states or None, the seed to re-seed with or None, the reader)."""
    reader = open_reader(iter_dir, fmt)
    check_model_compatible(reader.model_config, module.config, where=iter_dir)
    check_math_flags(reader.args, module.config, where=iter_dir)
    reader.use_vocab(module.config.vocab_size)
    state = reshard_model(
        reader,
        module.state_dict().keys(),
        layer_offset=module.layer_range[0],
        tp=TPLayout.of(ps),
        tp_rank=ps.tp_rank,
        padded_vocab_size=module.padded_vocab_size,
    )
    load_model_state(module, state, iter_dir)
    if finetune:
        return None, None, None, reader
    if load_optim:
        full = reshard_optimizer(
            reader,
            [n for n, _ in module.named_parameters()],
            layer_offset=module.layer_range[0],
            tp=TPLayout.of(ps),
            tp_rank=ps.tp_rank,
            padded_vocab_size=module.padded_vocab_size,
        )
        try:
            optimizer.load_full_state_dict(full)
        except ValueError as e:
            raise CheckpointError(f"{str(e).splitlines()[0]}; or pass --no-load-optim") from None
    iteration = int(reader.meta["iteration"])
    saved = reader.meta.get("megatron_scheduler") or {}
    steps = scheduler_steps_from_samples(
        saved.get("num_steps", reader.meta["consumed_train_samples"]),
        scheduler.samples_per_step,
    )
    scheduler.load_state_dict({**scheduler.state_dict(), "num_steps": steps})
    current = scheduler.state_dict()
    if saved and float(saved.get("max_lr", current["max_lr"])) != float(current["max_lr"]):
        logger.warning(
            "the Megatron checkpoint's --lr %s differs from this run's %s; this run's is used",
            saved.get("max_lr"),
            current["max_lr"],
        )
    if not load_rng:
        return reader.meta, None, None, reader
    rng_state, why = _rng_for_rank(reader, ps)
    if rng_state is not None:
        return reader.meta, rng_state, None, reader
    reseed = seed + iteration
    saved_layout = f"{fmt} format, TP {reader.tp_size} x PP {reader.pp_size}"
    logger.warning(
        "Megatron checkpoint %s (%s): RNG states not restored (%s); Python, numpy, torch and "
        "tensor-parallel generators re-seeded with --seed + iteration = %d",
        iter_dir,
        saved_layout,
        why,
        reseed,
    )
    return reader.meta, None, reseed, reader


def _rng_for_rank(reader: MegatronReader, ps: ParallelState) -> tuple[dict | None, str]:
    """This rank's saved RNG states in megalite's form, or (None, why not)."""
    if (reader.tp_size, reader.pp_size) != (ps.tp_size, ps.pp_size):
        return None, f"saved at another layout than this run's TP {ps.tp_size} x PP {ps.pp_size}"
    entries = reader.rng_states(ps.tp_rank, ps.pp_rank)
    if not entries:
        return None, "saved with --no-save-rng"
    dp_size, dp_rank = ps.size("dp", "cp"), ps.rank("dp", "cp")
    if len(entries) == dp_size:
        return rng_state_from_megatron(entries[dp_rank]), ""
    if arg(reader.args, "data_parallel_random_init", False):
        return (
            None,
            f"--data-parallel-random-init states of DP {len(entries)}, this run's {dp_size}",
        )
    # without --data-parallel-random-init every DP rank of Megatron holds the same states: [0]
    return rng_state_from_megatron(entries[0]), ""
