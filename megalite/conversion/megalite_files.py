"""Write a megalite checkpoint from logical tensors, for any (TP, PP) layout, in one process.

The converters' way into megalite: ``SAVE/release/mp_rank_XX[_YYY]/model_optim_rng.pt`` with the
model only (no optimizer, no RNG), and ``latest_checkpointed_iteration.txt`` = ``release``. A run
started with ``--load SAVE`` then takes the weights and starts at iteration 0 (as ``--finetune``),
under the layout it was written for or any other (resharding on load).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megalite.checkpoint.experts import is_expert_name, write_expert_files
from megalite.checkpoint.files import (
    MODEL_FILE,
    RELEASE,
    fsync_dir,
    iteration_dir,
    save_file,
    shard_dir,
    write_tracker,
)
from megalite.checkpoint.records import layout_record, plain_data, shard_header
from megalite.checkpoint.resharding import (
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    local_name,
    logical_name,
    stage_of,
)
from megalite.checkpoint.tp_shards import split_tp, tp_split
from megalite.models.config import GPTConfig


def stage_names(names: list[str], config: GPTConfig, *, pp_rank: int, pp_size: int) -> list[str]:
    """The global names of the parameters stage ``pp_rank`` holds (the tied output layer of a
    last stage without the embedding included)."""
    ranges = config.stage_layer_ranges(pp_size)
    out = [n for n in names if stage_of(n, ranges) == pp_rank]
    tied = not config.untie_embeddings_and_output_weights
    if tied and pp_size > 1 and pp_rank == pp_size - 1:
        out.append(OUTPUT_LAYER)
    return out


def write_checkpoint(
    state: dict[str, torch.Tensor],
    config: GPTConfig,
    save_dir: str,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    iteration: int | str = RELEASE,
    extra_record: dict | None = None,
) -> str:
    """Write the logical tensors ``state`` of the model ``config`` as a checkpoint of
    ``tp_size`` x ``pp_size`` shards; returns the iteration directory. ``extra_record`` goes into
    the recorded flags (e.g. the tokenizer the model comes with)."""
    try:
        config.validate(tp_size=tp_size, pp_size=pp_size)
    except ValueError as e:
        raise ValueError(str(e)) from None
    tied = not config.untie_embeddings_and_output_weights
    names = [n for n in state if logical_name(n, tied=tied) == n and not is_expert_name(n)]
    if WORD_EMBEDDING not in state:
        raise ValueError(f"the weights have no {WORD_EMBEDDING}")
    ranges = config.stage_layer_ranges(pp_size)
    padded = config.padded_vocab_size(tp_size)
    record = {"model": plain_data(dataclasses.asdict(config)), **(extra_record or {})}
    iter_dir = iteration_dir(save_dir, iteration)
    for p in range(pp_size):
        held = stage_names(names, config, pp_rank=p, pp_size=pp_size)
        for t in range(tp_size):
            model = {}
            for name in held:
                split = tp_split(name, swiglu=config.swiglu)
                full = state[logical_name(name, tied=tied)]
                model[local_name(name, ranges[p][0])] = split_tp(
                    full, split, tp_size=tp_size, tp_rank=t, padded_vocab_size=padded
                ).clone()
            layout = layout_record(
                tp_size=tp_size,
                pp_size=pp_size,
                dp_size=1,
                tp_rank=t,
                pp_rank=p,
                layer_ranges=ranges,
                padded_vocab_size=padded,
                distributed_optimizer=False,
            )
            header = shard_header(
                iteration=iteration,
                consumed_train_samples=0,
                consumed_valid_samples=0,
                config=record,
                layout=layout,
                model=model,
                optimizer=None,
                scheduler=None,
                rng_state=None,
            )
            folder = shard_dir(iter_dir, tp_rank=t, pp_rank=p, pp_size=pp_size)
            os.makedirs(folder, exist_ok=True)
            save_file(header, os.path.join(folder, MODEL_FILE))
            fsync_dir(folder)
    write_expert_files(state, iter_dir, ranges, config.swiglu)  # by global expert index
    fsync_dir(iter_dir)
    write_tracker(save_dir, iteration)
    return iter_dir
