"""What a checkpoint records: the header of a shard file, RNG states and the model's config.

- Header: ``shard_header`` is the content of every ``model_optim_rng.pt`` (training saves and
  converted checkpoints alike), with its ``layout_record``.

- RNG: torch's default CPU generator, the CUDA generator of this device, the TP tracker's states,
  and python's and numpy's global generators (cheap, and a user's forward step may use them).
- Config: the run's settings as plain data (``plain_data``: dtypes as strings) under
  ``header["config"]``; its ``"model"`` entry is the ``GPTConfig``, from which a load names the
  setting in which the checkpoint's model differs from this run's, and from which ``load_model``
  rebuilds the model. What else goes in (the training flags, the tokenizer) is the caller's.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import torch

from megalite.checkpoint.files import FORMAT_VERSION, CheckpointError
from megalite.models.config import GPTConfig

logger = logging.getLogger(__name__)

# GPTConfig fields that fix a parameter's shape -> the flag that sets them
SHAPE_FLAGS = {  # the family-defining settings first: they explain the size differences
    "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization",
    "swiglu": "--swiglu",
    "add_bias_linear": "--disable-bias-linear (off = biases)",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (the tokenizer's vocabulary)",
}
# fields that change the function but not the shapes: a difference is logged
FUNCTION_FLAGS = {
    "openai_gelu": "--openai-gelu",
    "rotary_base": "--rotary-base",
    "norm_epsilon": "--norm-epsilon",
}


# --- the shard file ------------------------------------------------------------------------------


def layout_record(
    *,
    tp_size: int,
    pp_size: int,
    dp_size: int,
    tp_rank: int,
    pp_rank: int,
    layer_ranges: list[tuple[int, int]],
    padded_vocab_size: int,
    distributed_optimizer: bool,
    stage_ranks: list[tuple[int, int]] | None = None,
    tp_mode: str = "1d",
    tp_depth: int = 1,
) -> dict:
    """``header["layout"]``: the layout a shard was saved under (``layer_ranges``: the layers of
    every stage, by index in the whole model; ``dp_size``: the ranks of the data-parallel group,
    ``ps.size("dp", "cp")``). Several chunks per rank (virtual stages): ``layer_ranges`` lists every
    GLOBAL stage in stage order and ``stage_ranks`` the (pp rank, chunk) holding each. A grid
    tensor-parallel mode records ``tp_mode`` and ``tp_depth`` (absent: 1d)."""
    chunks = {}
    if stage_ranks is not None:
        chunks = {
            "num_chunks": 1 + max(c for _, c in stage_ranks),
            "stage_ranks": [list(x) for x in stage_ranks],
        }
    return {
        "tp_size": tp_size,
        "pp_size": pp_size,
        "dp_size": dp_size,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "layer_ranges": [list(r) for r in layer_ranges],
        "padded_vocab_size": padded_vocab_size,
        "distributed_optimizer": distributed_optimizer,
        **chunks,
        **({} if tp_mode == "1d" else {"tp_mode": tp_mode, "tp_depth": tp_depth}),
    }


def shard_header(
    *,
    iteration: int | str,
    consumed_train_samples: int,
    consumed_valid_samples: int,
    config: dict,
    layout: dict,
    model: dict,
    optimizer: dict | None,
    scheduler: dict | None,
    rng_state: list | None,
) -> dict:
    """The content of one ``model_optim_rng.pt``: ``model`` = the stage's state dict (local
    names), ``optimizer`` = the plain optimizer's per-parameter state, ``{"distributed": True}``
    (ZeRO-1: in the ``distrib_optim`` files) or None, ``rng_state`` = every DP rank's states."""
    return {
        "megalite_checkpoint": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "config": config,
        "layout": layout,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng_state": rng_state,
    }


# --- RNG -----------------------------------------------------------------------------------------


def capture_rng_state(tracker, device: torch.device) -> dict:
    """Every RNG state of this rank (``tracker``: the TP RNGStatesTracker or None)."""
    np_state = np.random.get_state()
    return {
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "tracker": tracker.get_states() if tracker is not None else None,
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }


def restore_rng_state(state: dict, tracker, device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    # the device and tracker states are generator states of the device kind that saved them (a
    # CPU one would not fit the CUDA generator, nor back): restored only on the same kind
    saved_on_cuda = state.get("cuda") is not None
    if saved_on_cuda != (device.type == "cuda"):
        saved_on = "cuda" if saved_on_cuda else "cpu"
        logger.warning(
            "RNG states saved on %s, restored on %s: the %s and tensor-parallel generators keep "
            "their start-up seeding (CPU, Python and numpy states restored)",
            saved_on,
            device.type,
            device.type,
        )
    else:
        if saved_on_cuda:
            torch.cuda.set_rng_state(state["cuda"], device)
        if tracker is not None and state.get("tracker") is not None:
            tracker.set_states(state["tracker"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


# --- config ---------------------------------------------------------------------------------------


def plain_data(value):
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def gpt_config_from_record(record: dict, **overrides) -> GPTConfig:
    """Rebuild the ``GPTConfig`` a checkpoint recorded (``record = meta["config"]["model"]``)."""
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    kwargs = {k: v for k, v in record.items() if k in names}
    dtype = kwargs.get("params_dtype")
    if isinstance(dtype, str):
        kwargs["params_dtype"] = getattr(torch, dtype.removeprefix("torch."))
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_model_compatible(saved: dict, current: GPTConfig, *, where: str) -> None:
    """Raise a one-line CheckpointError naming the first shape setting in which the checkpoint's
    model (``saved``, its recorded GPTConfig) differs from this run's; log function settings
    that differ."""
    now = dataclasses.asdict(current)
    fields = dict(SHAPE_FLAGS)
    if current.position_embedding_type == "learned_absolute":
        fields["max_position_embeddings"] = "--max-position-embeddings"
    for key, flag in fields.items():
        if key in saved and saved[key] != now[key]:
            raise CheckpointError(
                f"checkpoint {where} has a model of another shape: {flag} is "
                f"{_show(saved[key])} in the checkpoint but {_show(now[key])} in this run; use "
                "the checkpoint's value (or another --load)"
            )
    for key, flag in FUNCTION_FLAGS.items():
        if key in saved and saved[key] != now[key]:
            logger.warning(
                "checkpoint %s was trained with %s %s, this run uses %s",
                where,
                flag,
                _show(saved[key]),
                _show(now[key]),
            )
