"""Checkpoints in Megatron's layout (DESIGN §5): save, load and reshard from explicit pieces.

    from megalite.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(save_dir, iteration, model_chunks=[gpt], optimizer=optimizer, ...)
    loaded = load_checkpoint(load_dir, model_chunks=[gpt], optimizer=optimizer, ...)

The package knows models and core, never the training loop: the caller passes the model chunks
(GPT stage modules), the optimizer, the scheduler, the mesh and the counters, and applies what a
load returns. ``megalite.training.checkpoint_io`` does that for the Trainer; ``megalite.inference``
and ``megalite.conversion`` read and write checkpoints through ``CheckpointReader`` and ``files``.

- ``files``: paths, crash-safe writes, the tracker file.
- ``records``: RNG states and the recorded model config.
- ``resharding``: the layout-independent (logical) form and ``CheckpointReader``.
- ``saving`` / ``loading``: ``save_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

from megalite.checkpoint.files import (
    FORMAT_VERSION,
    RELEASE,
    TRACKER_FILE,
    CheckpointError,
    read_tracker,
    saved_iterations,
)
from megalite.checkpoint.loading import LoadedCheckpoint, Progress, load_checkpoint
from megalite.checkpoint.resharding import CheckpointReader
from megalite.checkpoint.saving import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "RELEASE",
    "TRACKER_FILE",
    "CheckpointError",
    "CheckpointReader",
    "LoadedCheckpoint",
    "Progress",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "saved_iterations",
]
