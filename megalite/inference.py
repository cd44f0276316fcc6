"""``load_model``: any megalite checkpoint, whatever its layout, as one plain CPU model.

    from megalite import load_model
    model = load_model("checkpoints/gpt2")            # the tracker's iteration
    logits = model(tokens)                            # tokens # [b, s] -> # [b, s, vocab] fp32

For notebooks, evaluation and the HF converters: no process group, no padding of the vocabulary
(``make_vocab_size_divisible_by = 1``, so the logits have exactly ``vocab_size`` columns), fp32
weights (a bf16 run's weights are widened exactly), dropout off (``eval()``), sequence parallel and
recompute off. ``model.checkpoint_info`` says where it came from and records the run's flags.
"""

from __future__ import annotations

import os
import re

import torch

from megalite.checkpoint.experts import ExpertReader, expert_states, has_experts
from megalite.checkpoint.files import (
    RELEASE,
    TRACKER_FILE,
    CheckpointError,
    iteration_dir,
    read_tracker,
    saved_iterations,
)
from megalite.checkpoint.records import gpt_config_from_record
from megalite.checkpoint.resharding import CheckpointReader
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.random import TP_RNG, RNGStatesTracker
from megalite.models.gpt import GPTModel

_ITER_NAME = re.compile(r"^(iter_(\d+)|release)$")


class CausalLM(GPTModel):
    """A single-process GPTModel whose ``position_ids`` default to ``0..s-1``:
    ``model(tokens)`` -> logits # [b, s, vocab]; ``model(tokens, labels=labels)`` -> per-token
    loss # [b, s]. ``checkpoint_info``: where ``load_model`` read it from (path, iteration) and the
    run's recorded config and layout."""

    checkpoint_info: dict | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().forward(tokens, position_ids, labels)


def resolve_checkpoint(path: str, iteration: int | str | None = None) -> tuple[str, int | str]:
    """``(save_dir, iteration)`` for ``path`` = a ``--save`` directory (the tracker's iteration
    unless ``iteration`` is given) or one ``iter_0000500`` / ``release`` directory in it."""
    path = os.path.abspath(path)
    m = _ITER_NAME.match(os.path.basename(path))
    if m is not None and os.path.isdir(path):
        found: int | str = RELEASE if m.group(1) == RELEASE else int(m.group(2))
        return os.path.dirname(path), found if iteration is None else iteration
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    if iteration is None:
        iteration = read_tracker(path)
    if iteration is None:
        present = saved_iterations(path)
        raise CheckpointError(
            f"{path} has no {TRACKER_FILE}"
            + (f"; pass iteration= one of {present}" if present else " and no iter_* folder")
        )
    return path, iteration


def load_model(path: str, iteration: int | str | None = None) -> CausalLM:
    """The model of a megalite checkpoint (any TP / PP / DP layout) as one CPU ``GPTModel`` in fp32,
    in eval mode. ``path``: the ``--save`` directory or one of its ``iter_*`` folders;
    ``iteration``: which one (default: the latest complete, as the tracker says)."""
    save_dir, iteration = resolve_checkpoint(path, iteration)
    reader = CheckpointReader(iteration_dir(save_dir, iteration))
    config = gpt_config_from_record(
        reader.model_config,
        make_vocab_size_divisible_by=1,
        params_dtype=torch.float32,
        sequence_parallel=False,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
    )
    tracker = RNGStatesTracker()  # only used if someone trains it with dropout
    tracker.add(TP_RNG, config.seed + 2718)
    with torch.device("cpu"):
        model = CausalLM(config, ParallelState.single(), rng_tracker=tracker)
    experts = {}  # MoE experts from their own files, by global expert index
    if has_experts(model):
        expert_reader = ExpertReader(reader.iter_dir, reader.layer_ranges)
        single = ParallelState.single()
        experts, _ = expert_states(expert_reader, model, single, with_optimizer=False)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            full = experts[name] if name in experts else reader.model_tensor(name)
            if tuple(full.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{reader.iter_dir}: {name} has shape {tuple(full.shape)}, the model its "
                    f"flags describe needs {tuple(param.shape)}; the checkpoint is inconsistent"
                )
            param.copy_(full)
    model.eval()
    model.checkpoint_info = {
        "path": reader.iter_dir,
        "iteration": iteration,
        "config": reader.meta["config"],
        "layout": reader.meta["layout"],
    }
    return model
