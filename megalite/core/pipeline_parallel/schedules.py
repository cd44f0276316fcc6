"""Forward-backward schedules over micro-batches.

All schedules share one contract, so the training loop calls whichever the layout needs:

    losses = schedule(forward_step_func=..., data_iterator=[it], model=[chunk],
                      num_microbatches=..., forward_only=False, ...)

``model`` is the list of this rank's model chunks and ``data_iterator`` one iterator (or None) per
chunk: one chunk today, several virtual stages later. A bare module / iterator is taken as a list
of one. ``forward_step_func(data_iterator, model) -> (output, loss_func)`` runs one chunk on the
next micro-batch of its iterator; on the last stage ``loss_func(output) -> (loss, {name: detached
value})`` reduces the per-token output to a scalar. The schedule divides each micro-batch's loss by
``num_microbatches`` before backward, so the grads accumulated over a step are those of the mean
loss. It returns the list of per-micro-batch ``{name: value}`` dicts on the last stage (empty
elsewhere).

Grad sync. The schedule, not a counter, tells the data-parallel wrappers which micro-batch is the
last: every backward but the last one it runs happens inside each chunk's ``no_sync()`` (chunks
without one, e.g. a bare module, are left alone), so a wrapper may start its bucket reductions as
soon as the last backward delivers a bucket's grads.

Pipeline schedules also take a ``P2PCommunicator``; a non-first stage's input is the received
activation, set on the chunk (``set_input_tensor``) before ``forward_step_func`` runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd import Variable

from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.timeline import Timeline


def _check_chunks(model, data_iterator) -> tuple[list[nn.Module], list[Iterator | None]]:
    if not isinstance(model, (list, tuple)) or not isinstance(data_iterator, (list, tuple)):
        raise TypeError(
            "model and data_iterator are lists (one model chunk and its data iterator per "
            f"virtual stage), got {type(model).__name__} and {type(data_iterator).__name__}"
        )
    if len(model) != 1 or len(data_iterator) != 1:
        raise ValueError(
            f"these schedules run one model chunk with one data iterator, got {len(model)} "
            f"chunks and {len(data_iterator)} iterators"
        )
    return list(model), list(data_iterator)


def no_sync(model: Sequence[nn.Module]) -> contextlib.ExitStack:
    """Every chunk's ``no_sync()`` at once (chunks without one are skipped)."""
    stack = contextlib.ExitStack()
    for chunk in model:
        chunk_no_sync = getattr(chunk, "no_sync", None)
        if chunk_no_sync is not None:
            stack.enter_context(chunk_no_sync())
    return stack


def _grad_sync_context(model: Sequence[nn.Module], backward_index: int, num_microbatches: int):
    """``no_sync`` for every backward but the last of the step (index ``num_microbatches - 1``)."""
    if backward_index < num_microbatches - 1:
        return no_sync(model)
    return contextlib.nullcontext()


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **_unused,
) -> list[dict]:
    """One stage holds the whole model: forward and backward each micro-batch in turn, the grads
    accumulating (all but the last backward inside ``no_sync``). ``grad_scale_func`` (the fp16
    loss scaler) scales the loss before backward."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    model, data_iterator = _check_chunks(model, data_iterator)
    losses = []
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    for i in range(num_microbatches):
        with grad_ctx:
            output, loss_func = forward_step_func(data_iterator[0], model[0])
            loss, reported = loss_func(output)
        losses.append(reported)
        if not forward_only:
            loss = loss / num_microbatches
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            with _grad_sync_context(model, i, num_microbatches):
                loss.backward()
    return losses


class _Stage:
    """What one pipeline stage does to one micro-batch: forward, backward, with the bookkeeping."""

    def __init__(
        self, *, forward_step_func, data_iterator, model, num_microbatches, is_last_stage,
        forward_only, grad_scale_func, timeline,
    ):  # fmt: skip
        self.forward_step_func, self.data_iterator, self.model = (
            forward_step_func,
            data_iterator,
            model,
        )
        self.num_microbatches, self.is_last_stage = num_microbatches, is_last_stage
        self.forward_only, self.grad_scale_func = forward_only, grad_scale_func
        self.timeline = timeline or Timeline()
        self.losses: list[dict] = []
        self.backwards = 0  # run so far: the last one of the step runs outside no_sync

    def forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """Run one micro-batch; return the activation to send (scaled loss on the last stage)."""
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()
        grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with self.timeline.span("forward"), grad_ctx:
            _unwrap(self.model[0]).set_input_tensor(input_tensor)
            output, loss_func = self.forward_step_func(self.data_iterator[0], self.model[0])
            if not self.is_last_stage:
                return output
            loss, reported = loss_func(output)
            self.losses.append(reported)
            return loss / self.num_microbatches

    def backward(
        self,
        input_tensor: torch.Tensor | None,
        output_tensor: torch.Tensor,
        output_grad: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Backpropagate one micro-batch; return the grad of its input (None on the first stage)."""
        sync = _grad_sync_context(self.model, self.backwards, self.num_microbatches)
        self.backwards += 1
        with self.timeline.span("backward"), sync:
            if output_grad is None:  # last stage: the output is the loss
                if self.grad_scale_func is not None:
                    output_tensor = self.grad_scale_func(output_tensor)
                output_tensor.backward()
            else:
                _backward_freed_output(output_tensor, output_grad)
        return None if input_tensor is None else input_tensor.grad


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under the wrappers of one chunk (the one with ``set_input_tensor``)."""
    while not hasattr(model, "set_input_tensor") and hasattr(model, "module"):
        model = model.module
    return model


def free_output_storage(output: torch.Tensor | None) -> None:
    """After an activation is sent, keep its autograd node but drop its data: the next stage has a
    copy, and backward needs only the node. Saves one ``[s, b, h]`` per in-flight micro-batch."""
    if output is not None and output.grad_fn is not None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _backward_freed_output(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for an output whose storage was freed (autograd's Python entry
    point would reject the shape mismatch; the engine itself only needs the node)."""
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def forward_backward_pipelining_1f1b(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[nn.Module],
    num_microbatches: int,
    p2p: P2PCommunicator,
    pp_rank: int,
    pp_size: int,
    forward_only: bool = False,
    grad_scale_func: Callable | None = None,
    timeline: Timeline | None = None,
    **_unused,
) -> list[dict]:
    """1F1B without interleaving (PipeDream-Flush): after a warmup of forwards, each stage
    alternates one forward and one backward, so it holds at most ``pp_size - pp_rank``
    micro-batches of activations instead of all of them. Works for any ``num_microbatches >= 1``
    (with fewer micro-batches than stages the warmup simply covers all of them)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    model, data_iterator = _check_chunks(model, data_iterator)
    stage = _Stage(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, is_last_stage=pp_rank == pp_size - 1,
        forward_only=forward_only, grad_scale_func=grad_scale_func, timeline=timeline,
    )  # fmt: skip
    # warmup: stage r runs forwards until the first backward can reach it
    num_warmup = min(pp_size - pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    inputs: list[torch.Tensor | None] = []  # FIFO of in-flight micro-batches
    outputs: list[torch.Tensor] = []

    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward()
        output = stage.forward(input_tensor)
        p2p.send_forward(None if stage.is_last_stage else output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
            if not stage.is_last_stage:
                free_output_storage(output)

    # steady state: one forward, one backward
    input_tensor = p2p.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output = stage.forward(input_tensor)
        send = None if stage.is_last_stage else output
        if forward_only:
            p2p.send_forward(send)
            input_tensor = None if last else p2p.recv_forward()
            continue
        output_grad = p2p.send_forward_recv_backward(send)
        inputs.append(input_tensor)
        outputs.append(output)
        if not stage.is_last_stage:
            free_output_storage(output)
        input_tensor = stage.backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last:
            p2p.send_backward(input_tensor)
            input_tensor = None
        else:
            input_tensor = p2p.send_backward_recv_forward(input_tensor)

    # cooldown: drain the backwards of the warmup micro-batches
    if not forward_only:
        for _ in range(num_warmup):
            output_grad = p2p.recv_backward()
            p2p.send_backward(stage.backward(inputs.pop(0), outputs.pop(0), output_grad))
    return stage.losses


def forward_backward_pipelining_gpipe(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[nn.Module],
    num_microbatches: int,
    p2p: P2PCommunicator,
    pp_rank: int,
    pp_size: int,
    forward_only: bool = False,
    grad_scale_func: Callable | None = None,
    timeline: Timeline | None = None,
    **_unused,
) -> list[dict]:
    """GPipe: all forwards, then all backwards (in reverse). Holds every micro-batch's activations;
    kept beside 1F1B for comparison (``--pipeline-schedule gpipe``)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    model, data_iterator = _check_chunks(model, data_iterator)
    stage = _Stage(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, is_last_stage=pp_rank == pp_size - 1,
        forward_only=forward_only, grad_scale_func=grad_scale_func, timeline=timeline,
    )  # fmt: skip
    inputs, outputs = [], []
    for _ in range(num_microbatches):
        input_tensor = p2p.recv_forward()
        output = stage.forward(input_tensor)
        p2p.send_forward(None if stage.is_last_stage else output)
        inputs.append(input_tensor)
        outputs.append(output)
        if not stage.is_last_stage:
            free_output_storage(output)
    if not forward_only:
        for _ in range(num_microbatches):
            output_grad = p2p.recv_backward()
            p2p.send_backward(stage.backward(inputs.pop(), outputs.pop(), output_grad))
    return stage.losses
