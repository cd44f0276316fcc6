"""Checkpoints in Megatron's layout (DESIGN §5): save, load and reshard from explicit pieces.

    from megalite.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(save_dir, iteration, model_chunks=[gpt], optimizer=optimizer, ...)
    loaded = load_checkpoint(load_dir, model_chunks=[gpt], optimizer=optimizer, ...)

The package knows models and core, never the training loop: the caller passes the model chunks
(GPT stage modules), the optimizer, the scheduler, the mesh and the counters, and applies what a
load returns. ``megalite.training.checkpoint_io`` does that for the Trainer; ``megalite.inference``
and ``megalite.conversion`` read and write checkpoints through ``CheckpointReader`` and ``files``.

The native format, bottom up (each imports only those above it):

- ``files``: paths, crash-safe writes, the tracker file.
- ``records``: RNG states and the recorded model config.
- ``tp_shards``: how each tensor-parallel mode (1d, 2d, 2.5d, 3d) cuts a logical tensor, and back.
- ``resharding``: the layout-independent (logical) form and ``CheckpointReader``.
- ``experts``: MoE experts by global expert index; ``chunks``: several model chunks per rank.
- ``saving`` / ``loading``: ``save_checkpoint`` / ``load_checkpoint`` of megalite's own files.

Above them, ``megatron/``: Megatron-LM's ``torch`` and ``torch_dist`` formats, read and written
through the native modules; and ``formats``, the choice between the formats
(``save_checkpoint`` / ``load_checkpoint`` here are its).
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
from megalite.checkpoint.formats import CKPT_FORMATS, load_checkpoint, save_checkpoint
from megalite.checkpoint.loading import LoadedCheckpoint, Progress
from megalite.checkpoint.resharding import CheckpointReader

__all__ = [
    "CKPT_FORMATS",
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
