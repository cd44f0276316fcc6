"""torch.distributed.checkpoint, imported when a ``torch_dist`` checkpoint is first read or written.

Importing it costs about 1 s of CPU per process (torch 2.13 on this CPU), which every run, tool
and test worker that imports the training package would otherwise pay without touching the
format."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def torch_dcp() -> ModuleType:
    return importlib.import_module("torch.distributed.checkpoint")
