"""Run one rank's action list (``actions.py``): the one executor behind every schedule.

    losses = execute(lists[pp_rank], layout=layout, pp_rank=r, forward_step_func=...,
                     model=[ModelChunk(...), ...], data_iterator=[...], num_microbatches=m, p2p=p2p)

Per (micro-batch, chunk) it keeps the input received (or handed over by the previous chunk of the
same rank, at the turn of a V), the output, and the grad of the output. F runs
``forward_step_func(data_iterator[c], model[c].module)`` after ``set_input_tensor``; on the stage
that holds the loss it applies ``loss_func``, divides by ``num_microbatches`` (and applies
``grad_scale_func`` before backward). B runs the backward; I runs it with the chunk's linear
layers deferring their weight grads into a ``WeightGradStore`` keyed by the micro-batch; W
computes them.

Communication: ``actions`` is this rank's ``actions.p2p_program`` (compute actions and
``P2PBatch`` es); each batch is posted as ONE batch (``P2PCommunicator.post``: one
``batch_isend_irecv`` on nccl) of the ops ``actions.posting_plan`` lists, in that order
(``p2p_program``'s docstring says why this is deadlock-free and FIFO-correct on nccl, which ignores
tags). The plan is resolved once per program and communicator (``posting.plan_for``), and the
receive buffers come from the communicator's pool, reused once nothing holds them
(``p2p.ReceiveBuffers``); per action the hot path does no string formatting, enters no context
and calls no recorder unless a timeline or the recorder is on. Sends are never waited for: once a
send is done (polled oldest first) the executor drops its reference to the sent output and keeps
only the output's autograd edge (``release_output``; the next stage has a copy). On gloo a send
reports done only once waited for, so with overlap the release comes at the end of the step (no
saving on CPU); nccl's works report it as it happens. With overlap a received tensor is waited
for by its consumer; without (``P2PCommunicator(overlap=False)``) the whole batch is waited for
right after posting. Messages carry a tag per (direction, micro-batch, stage) for gloo;
``P2PCommunicator(tagged=False)`` sends all with tag 0, as nccl would see them (the tests run
that on gloo, which then matches by posting order). A plain SEND / RECV action (a flat list of
``with_p2p``) is posted as a batch of one.

Grad sync: every compute action runs inside the ``no_sync()`` of every chunk except the chunks for
which it is the last action touching their grads (their last B, I or W of the step), so the
data-parallel wrappers learn each parameter's last micro-batch from the schedule
(``ModelChunk.no_sync``: the chunk's grad wrapper's).

Losses are returned on the last pipeline rank (as for 1F1B), also when the loss stage lives on
another rank (a V layout computes it on rank 0): the loss rank sends them over, by the names
kept in ``P2PCommunicator.loss_names``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megalite.core.op_record import RECORDER
from megalite.core.pipeline_parallel.actions import Action, P2PBatch, StageLayout
from megalite.core.pipeline_parallel.data_iterators import per_chunk_iterators
from megalite.core.pipeline_parallel.model_chunk import ModelChunk, check_model_chunks
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.posting import Plan, Post, plan_for
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import WeightGradStore, attach_weight_grad_store

_LABEL = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def release_output(
    output: torch.Tensor | GradientEdge | None,
) -> torch.Tensor | GradientEdge | None:
    """After an activation is sent: what backward needs of it, without the tensor. The next stage
    has a copy, and backward only needs the output's autograd edge (its ``grad_fn`` and output
    index), so the tensor is dropped and its storage goes with the last reference -- one
    ``[s, b, h]`` per in-flight micro-batch, as Megatron's swap of ``output.data`` saves. Unlike
    that swap it stays right when the chunk's last op saved its own output for backward (a
    ``tanh``, a ``sigmoid``), with or without saved-tensor hooks: the saved copy keeps the storage
    alive instead of being replaced by an empty tensor. An output without an autograd node (no
    grad needed) is kept as it is."""
    if isinstance(output, torch.Tensor) and output.grad_fn is not None:
        return get_gradient_edge(output)
    return output


def backward_freed_output(output: torch.Tensor | GradientEdge, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for an output (or the ``GradientEdge`` ``release_output`` kept of
    it); the engine itself only needs the node."""
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def no_sync(model: Sequence[ModelChunk]) -> contextlib.ExitStack:
    """Every chunk's ``no_sync()`` at once."""
    stack = contextlib.ExitStack()
    for chunk in model:
        stack.enter_context(chunk.no_sync())
    return stack


class _Run:
    """One step of one rank: the tensors in flight between its actions, and the actions."""

    def __init__(
        self,
        *,
        layout: StageLayout,
        pp_rank: int,
        forward_step_func: Callable,
        model: list[ModelChunk],
        data_iterator: Sequence[Iterator | None],
        num_microbatches: int,
        p2p: P2PCommunicator,
        forward_only: bool,
        grad_scale_func: Callable | None,
        timeline: Timeline | None,
    ):
        self.layout, self.rank = layout, pp_rank
        self.forward_step_func, self.model = forward_step_func, model
        self.data_iterator = per_chunk_iterators(data_iterator)
        self.m, self.p2p = num_microbatches, p2p
        self.forward_only, self.grad_scale_func = forward_only, grad_scale_func
        self.timeline = timeline
        self.recording = RECORDER.enabled  # fixed for the step: no recorder calls when off
        # chunks with a grad wrapper: only their no_sync() does anything
        self.wrapped = {chunk.index for chunk in model if chunk.grad_wrapper is not None}
        S = layout.num_stages
        self.stages = [layout.stage(pp_rank, c) for c in range(len(self.model))]
        self.is_loss = [s == S - 1 for s in self.stages]
        # where a chunk's output / input grad goes: True when the next / previous stage is a
        # chunk of this rank (the turn of a V: handed over in memory, not sent)
        self.output_stays = [s < S - 1 and layout.place(s + 1)[0] == pp_rank for s in self.stages]
        self.grad_stays = [s > 0 and layout.place(s - 1)[0] == pp_rank for s in self.stages]
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, stage)
        # (kind, mb, stage) -> (work, buffer, record); sends: (work, output key, record), oldest
        # first (a backend completes one peer's sends in posting order)
        self.recvs: dict[tuple[str, int, int], tuple[object, torch.Tensor, object]] = {}
        self.sends: collections.deque = collections.deque()
        self.to_send: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, dict] = {}
        self.stores = [WeightGradStore() for _ in self.model]

    # --- communication ------------------------------------------------------------------------

    def _poll_sends(self) -> None:
        """Release the outputs of the sends known done, oldest first; stop at the first that is
        not (the later ones are posted behind it)."""
        sends = self.sends
        while sends and sends[0][0].is_completed():
            self._sent(*sends.popleft())

    def _wait_sends(self) -> None:
        sends = self.sends
        while sends:
            work, key, rec = sends.popleft()
            if self.recording:
                RECORDER.wait(rec)
            work.wait()
            self._sent(work, key, rec)

    def _sent(self, work, key: tuple[int, int] | None, rec) -> None:
        if self.recording:
            RECORDER.end(rec)
        if key is not None and key in self.outputs:
            self.outputs[key] = release_output(self.outputs[key])

    def _post(self, ops: tuple[Post, ...]) -> None:
        """One batch of ``ops``, posted in their order (``P2PCommunicator.post``)."""
        if not ops:
            return
        p2p = self.p2p
        batch, frees = [], []
        for op in ops:
            if op.send:
                if op.kind == "F":
                    tensor = self.to_send.pop(op.out_key)
                    frees.append(op.out_key)  # released once the send is done
                    p2p.validate(tensor, "send to the next stage")
                else:
                    tensor = self.input_grads.pop(op.out_key)
                    frees.append(None)
                    p2p.validate(tensor, "send back")
                batch.append((True, tensor.detach().contiguous(), op.to, op.tag))
            else:
                frees.append(p2p.receive_buffers.take())
                batch.append((False, frees[-1], op.to, op.tag))
        recs = [self._record(op) for op in ops] if self.recording else [None] * len(ops)
        works = p2p.post(batch)
        for op, work, free, rec in zip(ops, works, frees, recs):
            if op.send:
                self.sends.append((work, free, rec))
            else:  # free: the receive buffer
                self.recvs[op.message] = (work, free, rec)
        if not p2p.overlap:  # synchronous p2p: the whole batch, now
            for op in ops:
                if not op.send:
                    self.mailbox[op.message] = self._take(op.message)
            self._wait_sends()

    def _take(self, key: tuple[str, int, int]) -> torch.Tensor:
        """The tensor of message ``key`` (kind, micro-batch, receiving stage), waited for."""
        if key in self.mailbox:
            return self.mailbox.pop(key)
        if key not in self.recvs:
            raise RuntimeError(
                f"pipeline rank {self.rank} needs {key[0]} of micro-batch {key[1]} at stage "
                f"{key[2]} but no receive was posted: run the lists of actions.p2p_program / "
                "with_p2p"
            )
        work, buf, rec = self.recvs.pop(key)
        if self.recording:
            RECORDER.wait(rec)
        if self.timeline is not None:
            with self.timeline.span("recv"):
                work.wait()
        else:
            work.wait()
        if self.recording:
            RECORDER.end(rec)
        return buf

    def _record(self, op: Post):
        """The recorder's record of a posted message."""
        return RECORDER.post(
            "send" if op.send else "recv",
            axis="pp",
            what="activation" if op.kind == "F" else "grad",
            peer=op.to,
            shape=self.p2p.shape,
            stage=op.message[2],
            microbatch=op.message[1],
            action="F" if op.kind == "F" else "B",
            chunk=op.out_key[1],
        )

    # --- compute ------------------------------------------------------------------------------

    def _span(self, a: Action):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(f"{_LABEL[a.op]} {a.microbatch}.{a.chunk}")

    def forward(self, a: Action) -> None:
        mb, c = a.microbatch, a.chunk
        s = self.stages[c]
        x = None if s == 0 else self._take(("F", mb, s))
        if x is not None and not self.forward_only:
            x.requires_grad_()
        stage = self.model[c].module
        if self.timeline is None and not self.forward_only:  # the hot path: no context to enter
            output = self._forward(stage, mb, c, x)
        else:
            grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
            with self._span(a), grad_ctx:
                output = self._forward(stage, mb, c, x)
        stage.set_input_tensor(None)
        if not self.forward_only:
            self.inputs[(mb, c)] = x
            self.outputs[(mb, c)] = output
        if self.output_stays[c]:  # the turn of a V: same rank
            self.mailbox[("F", mb, s + 1)] = output.detach()
        elif not self.is_loss[c]:
            self.to_send[(mb, c)] = output

    def _forward(self, stage: torch.nn.Module, mb: int, c: int, x: torch.Tensor | None):
        """The chunk's output for micro-batch ``mb`` (on the loss stage: its loss / m)."""
        stage.set_input_tensor(x)
        output, loss_func = self.forward_step_func(self.data_iterator[c], stage)
        if self.is_loss[c]:
            loss, reported = loss_func(output)
            self.losses[mb] = reported
            output = loss / self.m
        return output

    def backward(self, a: Action) -> None:
        mb, c = a.microbatch, a.chunk
        s = self.stages[c]
        x, output = self.inputs.pop((mb, c)), self.outputs.pop((mb, c))
        grad = None if self.is_loss[c] else self._take(("B", mb, s))
        if a.op == "I":  # the chunk's linear layers defer their weight grads to W
            with self._span(a), self.stores[c].defer((mb, c)):
                self._backward(output, grad)
        elif self.timeline is not None:
            with self._span(a):
                self._backward(output, grad)
        else:
            self._backward(output, grad)
        input_grad = None if x is None else x.grad
        if self.grad_stays[c]:
            self.mailbox[("B", mb, s - 1)] = input_grad
        else:
            self.input_grads[(mb, c)] = input_grad

    def _backward(self, output: torch.Tensor | GradientEdge, grad: torch.Tensor | None) -> None:
        if grad is None:  # the loss stage: the output is the scaled loss
            if self.grad_scale_func is not None:
                output = self.grad_scale_func(output)
            output.backward()
        else:
            backward_freed_output(output, grad)

    def weight(self, a: Action) -> None:
        with self._span(a):
            self.stores[a.chunk].flush((a.microbatch, a.chunk))

    # --- the list -----------------------------------------------------------------------------

    def run(self, plan: Plan) -> list[dict]:
        for chunk, store in zip(self.model, self.stores):
            attach_weight_grad_store(chunk.module, store)
        try:
            for is_compute, item, extra in plan.items:
                if self.sends:
                    self._poll_sends()
                if is_compute:
                    self._step(item, extra)
                else:
                    self._post(extra if self.forward_only else item)
            self._wait_sends()
        finally:
            for chunk in self.model:
                attach_weight_grad_store(chunk.module, None)
        if any(s.pending() for s in self.stores):
            raise RuntimeError("the action list left weight grads queued: an I without its W")
        return [self.losses[mb] for mb in sorted(self.losses)]

    def _step(self, a: Action, synced: tuple[int, ...]) -> None:
        """Run compute action ``a``; ``synced``: the chunks it runs inside ``no_sync`` (B, I, W)."""
        rec = None
        if self.recording:
            rec = RECORDER.begin(
                "compute",
                stage=self.stages[a.chunk],
                microbatch=a.microbatch,
                action=a.op,
                chunk=a.chunk,
            )
        if a.op == "F":
            self.forward(a)
        elif not self.forward_only:  # B, I or W
            run = self.weight if a.op == "W" else self.backward
            held = [self.model[k] for k in synced if k in self.wrapped] if self.wrapped else None
            if held:
                with no_sync(held):
                    run(a)
            else:
                run(a)
        if self.recording:
            RECORDER.end(rec)


def execute(
    actions: Sequence[Action | P2PBatch],
    *,
    layout: StageLayout,
    pp_rank: int,
    forward_step_func: Callable,
    model: list[ModelChunk],
    data_iterator: Sequence[Iterator | None],
    num_microbatches: int,
    p2p: P2PCommunicator,
    forward_only: bool = False,
    grad_scale_func: Callable | None = None,
    timeline: Timeline | None = None,
) -> list[dict]:
    """Run ``actions`` (this rank's ``p2p_program``, or a flat list of ``with_p2p``) over this
    rank's chunks (``model``, chunk 0 first); returns the per-micro-batch loss dicts on the last
    pipeline rank, [] elsewhere."""
    if len(model) != layout.num_chunks or len(data_iterator) != layout.num_chunks:
        raise ValueError(
            f"the schedule runs {layout.num_chunks} model chunk(s) per rank, got {len(model)} "
            f"chunks and {len(data_iterator)} data iterators"
        )
    p2p.check_neighbours()
    if RECORDER.enabled:
        RECORDER.coords["pp"] = pp_rank
    run = _Run(
        layout=layout,
        pp_rank=pp_rank,
        forward_step_func=forward_step_func,
        model=check_model_chunks(model),
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        p2p=p2p,
        forward_only=forward_only,
        grad_scale_func=grad_scale_func,
        timeline=timeline,
    )
    losses = run.run(plan_for(actions, layout, pp_rank, p2p))
    return p2p.losses_to_last_rank(losses, layout, pp_rank, num_microbatches)
