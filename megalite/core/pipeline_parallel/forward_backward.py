"""Forward-backward schedules over micro-batches.

All schedules share one contract, so the training loop calls whichever the layout needs:

    losses = forward_backward_func(forward_step_func=..., data_iterator=[it], model=[chunk],
                                   num_microbatches=..., forward_only=False, grad_scale_func=...)

``model`` is the list of this rank's model chunks (``ModelChunk``: the stage module, its grad
wrapper, its index), chunk 0 first: one chunk without virtual stages, several under the
interleaved and V schedules. ``data_iterator`` is a list with one iterator (or None) per chunk;
chunks given the same iterator each see every micro-batch once.
``forward_step_func(data_iterator, module) -> (output, loss_func)`` runs one chunk's module on the
next micro-batch of its iterator; on the last stage ``loss_func(output) -> (loss, {name: detached
value})`` reduces the per-token output to a scalar. The schedule divides each micro-batch's loss by
``num_microbatches`` before backward (and applies ``grad_scale_func``, the fp16 loss scaler, when
given), so the grads accumulated over a step are those of the mean loss. It returns the list of
per-micro-batch ``{name: value}`` dicts on the last pipeline stage (empty elsewhere).
``forward_only=True`` runs the forwards alone (evaluation).

Grad sync. The schedule, not a counter, tells the data-parallel wrappers which micro-batch is the
last: every backward but the last one it runs happens inside each chunk's ``no_sync()`` (a chunk
without a grad wrapper has nothing to hold back), so a wrapper may start its bucket reductions as
soon as the last backward delivers a bucket's grads.

Pipeline schedules also take a ``P2PCommunicator`` (it fixes the activation's shape and dtype)
and this rank's place (``pp_rank``, ``pp_size``); a non-first stage's input is the received
activation, set on the chunk's module (``set_input_tensor``) before ``forward_step_func`` runs.
Every pipeline schedule is an action-list generator (``generators.py``) run by the one executor
(``executor.py``); ``forward_backward_pipelining`` takes the schedule's name, the functions below
it are the named entry points for one chunk per rank (1F1B, GPipe).

``get_forward_backward_func(ps, ...)`` is the one place the training loop gets its schedule from:
no pipelining on one stage, else the named pipeline schedule bound to a ``P2PCommunicator`` for
the run and to this rank's place, so the loop never branches on the layout and passes the
contract's keywords alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.actions import p2p_program
from megalite.core.pipeline_parallel.executor import execute
from megalite.core.pipeline_parallel.generators import SCHEDULES, generate, layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk, check_model_chunks, no_sync
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.timeline import Timeline


def _check_lists(
    model: Sequence[ModelChunk], data_iterator: Sequence[Iterator | None]
) -> tuple[list[ModelChunk], list[Iterator | None]]:
    """``model`` and ``data_iterator`` as lists of one entry per chunk."""
    chunks = check_model_chunks(model)
    if not isinstance(data_iterator, (list, tuple)):
        raise TypeError(
            "data_iterator is a list (one iterator or None per model chunk), got "
            f"{type(data_iterator).__name__}"
        )
    if len(data_iterator) != len(chunks):
        raise ValueError(
            f"one data iterator per model chunk: got {len(chunks)} chunks and "
            f"{len(data_iterator)} iterators"
        )
    return chunks, list(data_iterator)


def _check_one_chunk(model: Sequence[ModelChunk], num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if len(model) != 1:
        raise ValueError(f"this schedule runs one model chunk per rank, got {len(model)}")


def _grad_sync_context(model: Sequence[ModelChunk], backward_index: int, num_microbatches: int):
    """``no_sync`` for every backward but the last of the step (index ``num_microbatches - 1``)."""
    if backward_index < num_microbatches - 1:
        return no_sync(model)
    return contextlib.nullcontext()


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[ModelChunk],
    num_microbatches: int,
    forward_only: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[dict]:
    """One stage holds the whole model: forward and backward each micro-batch in turn, the grads
    accumulating (all but the last backward inside ``no_sync``)."""
    model, data_iterator = _check_lists(model, data_iterator)
    _check_one_chunk(model, num_microbatches)
    module = model[0].module
    losses = []
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    for i in range(num_microbatches):
        with grad_ctx:
            output, loss_func = forward_step_func(data_iterator[0], module)
            loss, reported = loss_func(output)
        losses.append(reported)
        if not forward_only:
            loss = loss / num_microbatches
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            with _grad_sync_context(model, i, num_microbatches):
                loss.backward()
    return losses


def forward_backward_pipelining(
    *,
    schedule: str,
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[ModelChunk],
    num_microbatches: int,
    p2p: P2PCommunicator,
    pp_rank: int,
    pp_size: int,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
    grad_scale_func: Callable | None = None,
    timeline: Timeline | None = None,
) -> list[dict]:
    """Any schedule of ``generators.SCHEDULES`` over this rank's ``len(model)`` chunks:
    generate every rank's action list, run this rank's. Losses on the last pipeline rank.
    ``timeline`` records a span per action (``timeline.py``)."""
    model, data_iterator = _check_lists(model, data_iterator)
    num_chunks = len(model)
    programs = _programs(
        schedule, pp_size, num_microbatches, num_chunks, microbatch_group_size, forward_only
    )
    return execute(
        programs[pp_rank],
        layout=layout_of(schedule, pp_size, num_chunks),
        pp_rank=pp_rank,
        forward_step_func=forward_step_func,
        model=model,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        p2p=p2p,
        forward_only=forward_only,
        grad_scale_func=grad_scale_func,
        timeline=timeline,
    )


@functools.lru_cache(maxsize=32)
def _programs(schedule, pp_size, num_microbatches, num_chunks, microbatch_group_size, forward_only):
    """Every rank's ``p2p_program`` (the same on every rank; kept between steps)."""
    compute = generate(
        schedule,
        pp_size=pp_size,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        microbatch_group_size=microbatch_group_size,
        forward_only=forward_only,
    )
    programs = p2p_program(compute, layout_of(schedule, pp_size, num_chunks))
    return tuple(tuple(program) for program in programs)


def forward_backward_pipelining_1f1b(**kwargs) -> list[dict]:
    """1F1B without interleaving (PipeDream-Flush): after a warmup of ``min(p - r - 1, m)``
    forwards, each stage alternates one forward and one backward, so it holds at most
    ``min(p - r, m)`` micro-batches of activations. Any ``num_microbatches >= 1``. Keyword
    arguments as ``forward_backward_pipelining`` without ``schedule``."""
    _check_one_chunk(check_model_chunks(kwargs["model"]), kwargs["num_microbatches"])
    return forward_backward_pipelining(schedule="1f1b", **kwargs)


def forward_backward_pipelining_gpipe(**kwargs) -> list[dict]:
    """GPipe: all forwards, then all backwards (in reverse). Holds every micro-batch's
    activations; kept beside 1F1B for comparison (``pipeline_schedule="gpipe"``). Keyword
    arguments as ``forward_backward_pipelining`` without ``schedule``."""
    _check_one_chunk(check_model_chunks(kwargs["model"]), kwargs["num_microbatches"])
    return forward_backward_pipelining(schedule="gpipe", **kwargs)


def get_forward_backward_func(
    ps: ParallelState,
    *,
    pipeline_schedule: str = "1f1b",
    microbatch_group_size: int | None = None,
    overlap_p2p: bool = True,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    hidden_size: int | None = None,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Callable[..., list[dict]]:
    """The schedule for this layout: no pipelining on one stage; otherwise ``pipeline_schedule``
    (``generators.SCHEDULES``; the chunks per rank are ``len(model)`` at each call) with one
    ``P2PCommunicator`` for the run. Activations between stages are ``[s, b, h]``
    (``seq_length``, ``micro_batch_size``, ``hidden_size``), ``[s/tp, b, h]`` under sequence
    parallel, in ``dtype``: given here once, the returned function takes the contract's keywords
    alone."""
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {pipeline_schedule!r}"
        )
    if None in (seq_length, micro_batch_size, hidden_size):
        raise ValueError("a pipeline schedule needs seq_length, micro_batch_size and hidden_size")
    s = seq_length // ps.tp_size if sequence_parallel else seq_length
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=(s, micro_batch_size, hidden_size),
        dtype=dtype,
        device=ps.device,
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
        overlap=overlap_p2p,
    )
    return functools.partial(
        forward_backward_pipelining,
        schedule=pipeline_schedule,
        microbatch_group_size=microbatch_group_size,
        p2p=p2p,
        pp_rank=ps.pp_rank,
        pp_size=ps.pp_size,
    )
