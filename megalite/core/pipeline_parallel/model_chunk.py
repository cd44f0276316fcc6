"""One model chunk of this rank as the schedules run it: the stage module, its grad wrapper, its
index.

    model = [ModelChunk(module=stage, grad_wrapper=ddp)]          # ddp wraps stage
    losses = forward_backward_func(forward_step_func=..., data_iterator=[it], model=model, ...)

A rank runs one chunk per global stage it holds: one without virtual stages, ``v`` under the
interleaved schedules, two in a V. The schedules take the list of them, chunk 0 first
(``index`` is the position in that list: ``StageLayout.stage(pp_rank, index)`` is its stage).

- ``module``: the stage. ``forward_step_func(data_iterator, module)`` runs it; a stage after the
  first gets the received activation through ``module.set_input_tensor(x)`` first.
- ``grad_wrapper``: the data-parallel wrapper whose grad buffers hold this chunk's grads (the
  chunks of a rank may share one). The schedules run every backward but the chunk's last inside
  its ``no_sync()``, so the wrapper reduces a bucket only once its last grads are in. None: no
  wrapper (a bare stage), nothing is held back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelChunk:
    module: nn.Module
    grad_wrapper: nn.Module | None = None
    index: int = 0

    def no_sync(self) -> AbstractContextManager:
        """The grad wrapper's ``no_sync()``; nothing without a wrapper."""
        if self.grad_wrapper is None:
            return contextlib.nullcontext()
        return self.grad_wrapper.no_sync()


def check_model_chunks(model: object) -> list[ModelChunk]:
    """``model`` as a list of ``ModelChunk`` in index order; a TypeError / ValueError saying what
    the schedules take otherwise."""
    if not isinstance(model, (list, tuple)):
        raise TypeError(
            "model is a list of ModelChunk (one per model chunk of this rank), got "
            f"{type(model).__name__}"
        )
    for chunk in model:
        if not isinstance(chunk, ModelChunk):
            raise TypeError(
                "model is a list of ModelChunk (the stage module, its grad wrapper, its index), "
                f"got a {type(chunk).__name__} in it"
            )
    indices = [chunk.index for chunk in model]
    if indices != list(range(len(model))):
        raise ValueError(f"model chunks must come in index order 0, 1, ..., got indices {indices}")
    return list(model)


def no_sync(model: Sequence[ModelChunk]) -> contextlib.ExitStack:
    """Every chunk's ``no_sync()`` at once."""
    stack = contextlib.ExitStack()
    for chunk in model:
        stack.enter_context(chunk.no_sync())
    return stack
