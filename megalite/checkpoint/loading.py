"""Load a checkpoint of any layout into explicit pieces (model chunks, optimizer, scheduler).

    loaded = load_checkpoint(load_dir, model_chunks=[gpt], optimizer=optimizer,
                             scheduler=scheduler, ps=ps, seed=seed)
    ...set the counters from loaded.progress, build the data loaders from them...
    loaded.restore_rng(rng_tracker, ps=ps, device=device)  # last: the loaders draw nothing after

The same (TP, PP) layout reads its own shard directly (bitwise-exact resume: model, optimizer,
scheduler, loss scaler, data position, RNG). Another layout goes through the logical form
(``resharding.CheckpointReader``): full tensors by global name, cut for this rank; optimizer state
too, for the plain and the distributed optimizer alike. RNG states are restored only under the
same (TP, PP, DP) layout; otherwise the generators are re-seeded from ``seed`` + iteration.

Every rank calls it; it reads files and talks to no other rank, except that a ZeRO-1 optimizer
rebuilds its parameters from the loaded masters with an all-gather over its DP group.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from megalite.checkpoint.chunks import check_chunks
from megalite.checkpoint.experts import ExpertReader, expert_states, has_experts, is_expert_name
from megalite.checkpoint.files import (
    RELEASE,
    TRACKER_FILE,
    CheckpointError,
    distrib_optim_file,
    dp_rank_optim_file,
    iteration_dir,
    load_file,
    read_tracker,
)
from megalite.checkpoint.records import check_model_compatible, restore_rng_state
from megalite.checkpoint.resharding import (
    CheckpointReader,
    chunk_prefix,
    reshard_model,
    reshard_optimizer,
)
from megalite.checkpoint.tp_shards import TPLayout
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.random import model_parallel_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """Where the saved run stood: the iteration it had finished and the samples it had read."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` found and set; ``restore_rng`` applies its RNG states (or
    re-seeds)."""

    path: str  # the iteration directory
    iteration: int | str  # the directory's iteration (an int, or "release")
    progress: Progress | None  # None when only the weights were taken (finetune, release)
    rng_state: dict | None  # this rank's, when the layout is unchanged and load_rng is on
    reseed: int | None  # the seed to re-seed with when the RNG states cannot be restored

    def restore_rng(self, rng_tracker, *, ps: ParallelState, device: torch.device) -> None:
        """Set every generator of this rank (``rng_tracker``: the TP tracker or None) to the
        saved states, or re-seed them; nothing when neither applies (finetune, no load_rng)."""
        if self.rng_state is not None:
            restore_rng_state(self.rng_state, rng_tracker, device)
        elif self.reseed is not None:
            fresh = model_parallel_seed(
                self.reseed, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, device=device
            )
            if rng_tracker is not None:
                rng_tracker.set_states(fresh.get_states())


def load_model_state(module: nn.Module, state: dict, where: str) -> None:
    """Copy ``state`` (local names) into ``module``; a missing, unexpected or misshapen tensor is
    a one-line CheckpointError naming ``where`` (the checkpoint)."""
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


def _load_optimizer(
    optimizer,
    chunks: list[nn.Module],
    reader: CheckpointReader,
    ps: ParallelState,
    *,
    same_mp: bool,
    experts: ExpertReader | None = None,
) -> None:
    dp_rank, dp_size = ps.rank("dp", "cp"), ps.size("dp", "cp")
    if same_mp and optimizer.is_sharded and reader.distributed_optimizer:
        if reader.dp_size == dp_size:
            path = reader.path(ps.tp_rank, ps.pp_rank, distrib_optim_file(dp_rank))
            try:
                optimizer.load_sharded_state_dict(load_file(path))
                return
            except ValueError as e:  # another bucket layout: go through the full form
                logger.info("%s; loading it through the full optimizer state instead", e)
    if same_mp:
        state = reader.optimizer_state(ps.tp_rank, ps.pp_rank)
    else:
        state = {"params": {}}
        for c, module in enumerate(chunks):
            part = reshard_optimizer(
                reader,
                [n for n, _ in module.named_parameters() if not is_expert_name(n)],
                layer_offset=module.layer_range[0],
                tp=TPLayout.of(ps),
                tp_rank=ps.tp_rank,
                padded_vocab_size=module.padded_vocab_size,
            )
            prefix = chunk_prefix(len(chunks), c)
            state["params"].update({prefix + k: v for k, v in part.pop("params").items()})
            state.update(part)
    if experts is not None:  # this rank's experts, from the expert files
        state = {**state, "params": dict(state["params"])}
        state["params"].update(expert_states(experts, chunks[0], ps, with_optimizer=True)[1])
    try:
        optimizer.load_full_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"{str(e).splitlines()[0]}; or pass --no-load-optim") from None
    own = reader.path(ps.tp_rank, ps.pp_rank, dp_rank_optim_file(dp_rank))
    same_dp = same_mp and reader.dp_size == dp_size and os.path.exists(own)
    optimizer.load_dp_rank_state(load_file(own) if same_dp else None)


def _load_scheduler(scheduler, saved: dict | None, iteration: int) -> None:
    current = scheduler.state_dict()
    steps = saved["num_steps"] if saved else iteration  # fractional under a batch-size ramp
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
    """Load ``load_dir`` at ``iteration`` (``--ckpt-step``; default: the tracker's) into this
    rank's pieces; None (and a warning) when there is no checkpoint there yet.

    ``model_chunks``: this rank's GPT chunk modules, chunk 0 first (not the data-parallel
    wrappers), whose ``config`` is checked against the checkpoint's; any number per rank, from
    a checkpoint of any chunk layout. ``layer_ranges``: the layers of every global stage of this
    run in stage order (default: the config's split with one chunk; with several and none given,
    this rank's chunks alone decide whether the layout is unchanged). Sets the model, and unless
    ``finetune`` (or a ``release`` checkpoint: weights only) the scheduler and, with
    ``load_optim``, the optimizer; returns the saved counters (``progress``) for the caller to
    continue from and the RNG states to apply once the data loaders are built (``restore_rng``;
    ``load_rng=False`` keeps the generators as they are; ``seed`` + iteration re-seeds them when
    the layout changed). megalite's own files; ``formats.load_checkpoint`` also reads
    Megatron-LM's."""
    if not load_dir:
        raise CheckpointError("load_checkpoint needs a directory: pass --load DIR")
    chunks = check_chunks(model_chunks)
    module = chunks[0]
    if iteration is None:
        iteration = read_tracker(load_dir)
    if iteration is None:
        logger.warning(
            "--load %s: no %s there, so no checkpoint is loaded; training from scratch",
            load_dir,
            TRACKER_FILE,
        )
        return None
    started = time.perf_counter()
    iter_dir = iteration_dir(load_dir, iteration)
    reader = CheckpointReader(iter_dir)
    saved_layout = f"{reader.tp} x PP {reader.pp_size} x DP {reader.dp_size}"
    check_model_compatible(reader.model_config, module.config, where=iter_dir)
    if layer_ranges is None and len(chunks) == 1:
        layer_ranges = module.config.stage_layer_ranges(ps.pp_size)
    same_mp = (
        reader.tp == TPLayout.of(ps)
        and reader.pp_size == ps.pp_size
        and reader.num_chunks == len(chunks)
        and reader.chunk_ranges(ps.pp_rank) == [tuple(m.layer_range) for m in chunks]
        and (layer_ranges is None or reader.layer_ranges == [tuple(x) for x in layer_ranges])
        and reader.meta["layout"]["padded_vocab_size"] == module.padded_vocab_size
    )
    experts = None  # MoE experts come from their own files, by global expert index
    if has_experts(module):
        experts = ExpertReader(iter_dir, reader.layer_ranges)
    for c, chunk in enumerate(chunks):
        if same_mp:
            state = dict(reader.chunk_model(ps.tp_rank, ps.pp_rank, c))
        else:
            state = reshard_model(
                reader,
                [k for k in chunk.state_dict().keys() if not is_expert_name(k)],
                layer_offset=chunk.layer_range[0],
                tp=TPLayout.of(ps),
                tp_rank=ps.tp_rank,
                padded_vocab_size=chunk.padded_vocab_size,
            )
        if experts is not None:
            state.update(expert_states(experts, chunk, ps, with_optimizer=False)[0])
        load_model_state(chunk, state, iter_dir)
    header = reader.meta
    finetune = finetune or iteration == RELEASE
    progress, rng_state, reseed = None, None, None
    if not finetune:
        if load_optim:
            if not reader.has_optimizer():
                raise CheckpointError(
                    f"checkpoint {iter_dir} holds no optimizer state (saved with "
                    "--no-save-optim, or converted); pass --no-load-optim or --finetune"
                )
            _load_optimizer(optimizer, chunks, reader, ps, same_mp=same_mp, experts=experts)
        _load_scheduler(scheduler, header.get("scheduler"), int(header["iteration"]))
        progress = Progress(
            iteration=int(header["iteration"]),
            consumed_train_samples=int(header["consumed_train_samples"]),
            consumed_valid_samples=int(header.get("consumed_valid_samples", 0)),
        )
        if load_rng:
            saved = reader.shard(ps.tp_rank, ps.pp_rank).get("rng_state") if same_mp else None
            if saved is not None and len(saved) == ps.size("dp", "cp"):
                rng_state = saved[ps.rank("dp", "cp")]
            else:
                reseed = seed + progress.iteration
                logger.warning(
                    "RNG states not restored: the checkpoint's layout %s differs from this run's; "
                    "re-seeded with --seed + iteration = %d",
                    saved_layout,
                    reseed,
                )
    resharded = "" if same_mp else f", resharded to {TPLayout.of(ps)} x PP {ps.pp_size}"
    logger.info(
        "loaded checkpoint %s (%s%s) in %.2f s: iteration %d, %d samples consumed%s",
        iter_dir,
        saved_layout,
        resharded,
        time.perf_counter() - started,
        progress.iteration if progress else 0,
        progress.consumed_train_samples if progress else 0,
        " (--finetune: weights only)" if finetune else "",
    )
    return LoadedCheckpoint(iter_dir, iteration, progress, rng_state, reseed)
