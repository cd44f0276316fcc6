"""Megatron-LM's checkpoint formats (``--ckpt-format torch | torch_dist``), read and written.

Built on the native modules one way (``files``, ``records``, ``resharding``, ``saving``,
``loading``), which never import this package; ``checkpoint.formats`` chooses between the two.

- ``args``: what a Megatron run's ``args`` fix (shapes, math flags, stages).
- ``legacy``: the ``torch`` format's files, read safely; Adam state by index <-> by name.
- ``distopt``: the distributed optimizer's ``distrib_optim.pt`` (flat bucketed ranges).
- ``readers`` / ``dist``: ``LegacyReader`` (``torch``) and ``DistReader`` (``torch_dist``), both
  serving megalite's logical form.
- ``states``: RNG states and the scheduler position, Megatron's <-> megalite's.
- ``loading``: ``detect_format``, ``load_megatron_checkpoint``.
- ``writing`` / ``saving``: the logical form -> Megatron's files; the staged save in training and
  ``convert_to_megatron``.
"""

from __future__ import annotations

from megalite.checkpoint.megatron.args import MATH_FLAGS, check_math_flags, model_config_from_args
from megalite.checkpoint.megatron.dist import DistReader
from megalite.checkpoint.megatron.loading import (
    detect_format,
    load_megatron_checkpoint,
    open_reader,
)
from megalite.checkpoint.megatron.readers import LegacyReader, MegatronReader
from megalite.checkpoint.megatron.saving import convert_to_megatron, save_megatron_checkpoint
from megalite.checkpoint.megatron.states import (
    rng_state_from_megatron,
    rng_state_to_megatron,
    scheduler_samples_from_steps,
    scheduler_steps_from_samples,
)

__all__ = [
    "MATH_FLAGS",
    "DistReader",
    "LegacyReader",
    "MegatronReader",
    "check_math_flags",
    "convert_to_megatron",
    "detect_format",
    "load_megatron_checkpoint",
    "model_config_from_args",
    "open_reader",
    "rng_state_from_megatron",
    "rng_state_to_megatron",
    "save_megatron_checkpoint",
    "scheduler_samples_from_steps",
    "scheduler_steps_from_samples",
]
