"""Run one rank's action list (``actions.py``): the one executor behind every schedule.

    losses = execute(lists[pp_rank], layout=layout, pp_rank=r, forward_step_func=...,
                     model=[ModelChunk(...), ...], data_iterator=[...], num_microbatches=m, p2p=p2p)

Per (micro-batch, chunk) it keeps the input received (or handed over by the previous chunk of the
same rank, at the turn of a V), the output, and the grad of the output. F runs
``forward_step_func(data_iterator[c], model[c].module)`` after ``set_input_tensor``; on the stage
that holds the loss it applies ``loss_func``, divides by ``num_microbatches`` (and applies
``grad_scale_func`` before backward). B runs the backward; I runs it with the chunk's linear
layers deferring their weight grads into a ``WeightGradStore`` keyed by the micro-batch; W
computes them. With a ``Timeline`` each compute action is a span that holds all of the model's
work for it, as torch's schedules pay it too: an F's the received input made a leaf that wants
its grad and handed to the stage, the forward step and the loss; a B's or I's the backward, the
release of the micro-batch's graph and the read of its input's grad. What lies outside the
spans (and the receive waits') is the executor's and the backend's.

Communication: ``actions`` is this rank's ``actions.p2p_program``; each ``P2PBatch`` is posted as
ONE batch (one ``batch_isend_irecv`` on nccl) of the ops ``actions.posting_plan`` lists, in that
order (``p2p_program`` says why this is deadlock-free and FIFO-correct on nccl, which ignores
tags); where messages are matched by tag and posted op by op (gloo), each receive goes
``P2PCommunicator.receive_lead`` batches earlier, so that it is there before its send. The plan is
resolved once per program and communicator (``posting.plan_for``: each item's keys, peers and
posting call; on gloo the group's own ``send`` / ``recv``), receive buffers come from the
communicator's pool (``p2p.ReceiveBuffers``), and per action the hot path calls the item's
handler: no key built, no string formatted, no context entered, no recorder called unless
a timeline or the recorder is on. Sends are never waited for: once one is done (polled oldest
first) the executor keeps only the sent output's autograd edge (``release_output``; the next
stage has a copy); gloo reports a send done only once waited for (so on the CPU nothing is
polled and the release comes at the end of the step), nccl as it happens. With overlap a
received tensor is waited for by its consumer; without (``P2PCommunicator(overlap=False)``) the
batch is waited for right after posting. Tags:
one per (direction, micro-batch, stage); ``P2PCommunicator(tagged=False)`` sends all with tag 0,
as nccl sees them. A plain SEND / RECV action (a flat ``with_p2p`` list) is a batch of one.

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

from megalite.core.op_record import RECORDER
from megalite.core.pipeline_parallel.actions import Action, P2PBatch, StageLayout
from megalite.core.pipeline_parallel.data_iterators import per_chunk_iterators
from megalite.core.pipeline_parallel.model_chunk import ModelChunk, check_model_chunks, no_sync
from megalite.core.pipeline_parallel.outputs import release_output, run_freed_backward
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.posting import Compute, Plan, Post, plan_for
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import WeightGradStore, attach_weight_grad_store

_WHAT = {"F": "send to the next stage", "B": "send back"}  # what a mis-shaped send was


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
        self.modules = [chunk.module for chunk in model]
        self.data_iterator = per_chunk_iterators(data_iterator)
        self.m, self.p2p = num_microbatches, p2p
        self.forward_only, self.grad_scale_func = forward_only, grad_scale_func
        self.timeline = timeline
        self.recording = RECORDER.enabled  # fixed for the step: no recorder calls when off
        # chunks with a grad wrapper: only their no_sync() does anything
        self.wrapped = {chunk.index for chunk in model if chunk.grad_wrapper is not None}
        # a batch posted op by op straight on the group, nothing recorded, receives waited for
        # by their consumers: the hot path of ``_post``
        self.direct = not p2p.batched and p2p.overlap and not self.recording
        # (mb, chunk) -> (the input, the output) of a forward, until its backward
        self.held: dict[tuple[int, int], tuple] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, stage)
        # (kind, mb, stage) -> (work, buffer, record); sends: (work, output key, record), oldest
        # first (a backend completes one peer's sends in posting order)
        self.recvs: dict[tuple[str, int, int], tuple[object, torch.Tensor, object]] = {}
        self.sends: collections.deque = collections.deque()
        self.to_send: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, dict] = {}
        self.stores: list[WeightGradStore] = []  # per chunk, where the program has an I

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
            if self.recording or self.held:  # at a step's end every output is consumed already
                self._sent(work, key, rec)

    def _sent(self, work, key: tuple[int, int] | None, rec) -> None:
        if self.recording:
            RECORDER.end(rec)
        if key is not None:
            held = self.held.get(key)
            if held is not None:
                self.held[key] = (held[0], release_output(held[1]))

    def _post(self, ops: tuple[Post, ...], forward_ops: tuple[Post, ...]) -> None:
        """One batch of ``ops`` (a forward-only run: ``forward_ops``), posted in their order:
        on the hot path (``direct``) each op straight on the group, else through
        ``P2PCommunicator.post`` (one ``batch_isend_irecv`` on nccl) with the recorder's records,
        and without overlap the whole batch waited for at once."""
        if self.forward_only:
            ops = forward_ops
        if not ops:
            return
        p2p, direct = self.p2p, self.direct
        batch = []  # (send, tensor, peer, tag), (sent output key or receive buffer) per op
        for op in ops:
            if op.send:
                if op.kind == "F":  # the output is released once the send is done
                    tensor, key = self.to_send.pop(op.out_key), op.out_key
                else:
                    tensor, key = self.input_grads.pop(op.out_key), None
                if tensor.shape != p2p.shape or tensor.dtype != p2p.dtype:
                    p2p.validate(tensor, _WHAT[op.kind])
                tensor = tensor.contiguous()  # autograd plays no part in a send: no detach
                if direct:
                    self.sends.append((op.call([tensor], op.group_rank, op.tag), key, None))
                else:
                    batch.append(((True, tensor, op.to, op.tag), key))
            else:
                buf = p2p.receive_buffers.take()
                if direct:
                    self.recvs[op.message] = (op.call([buf], op.group_rank, op.tag), buf, None)
                else:
                    batch.append(((False, buf, op.to, op.tag), buf))
        if direct:
            return
        recs = [self._record(op) for op in ops] if self.recording else [None] * len(ops)
        works = p2p.post([posted for posted, _ in batch])
        for op, work, (_, kept), rec in zip(ops, works, batch, recs):
            if op.send:
                self.sends.append((work, kept, rec))
            else:
                self.recvs[op.message] = (work, kept, rec)
        if not p2p.overlap:  # synchronous p2p: the whole batch, now
            for op in ops:
                if not op.send:
                    self.mailbox[op.message] = self._take(op.message)
            self._wait_sends()

    def _take(self, key: tuple[str, int, int]) -> torch.Tensor:
        """The tensor of message ``key`` (kind, micro-batch, receiving stage), waited for."""
        mailbox = self.mailbox
        if mailbox and key in mailbox:
            return mailbox.pop(key)
        entry = self.recvs.pop(key, None)
        if entry is None:
            raise RuntimeError(
                f"pipeline rank {self.rank} needs {key[0]} of micro-batch {key[1]} at stage "
                f"{key[2]} but no receive was posted: run the lists of actions.p2p_program / "
                "with_p2p"
            )
        work, buf, rec = entry
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

    def _span(self, c: Compute):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(c.label)

    def forward(self, c: Compute, synced: tuple[int, ...] = ()) -> None:
        x = None if c.needs is None else self._take(c.needs)
        if self.forward_only:
            with self._span(c), torch.no_grad():
                output = self._forward(c, x)
        elif self.timeline is None:  # the hot path: no context to enter
            output = self._forward(c, x)
        else:
            with self.timeline.span(c.label):
                output = self._forward(c, x)
        if not self.forward_only:
            self.held[c.key] = (x, output)
        if c.hands is not None:  # the turn of a V: same rank
            self.mailbox[c.hands] = output.detach()
        elif c.sends:
            self.to_send[c.key] = output

    def _forward(self, c: Compute, x: torch.Tensor | None):
        """The chunk's output for ``c``'s micro-batch (on the loss stage: its loss / m): the
        model's whole forward, in the F span, with what torch's schedules do around it too (the
        received input made a leaf that wants its grad, handed to the stage). The stage keeps
        its input until its next F; ``run`` clears it at the end of the step."""
        stage = self.modules[c.chunk]
        if x is not None and not self.forward_only:
            x.requires_grad_()
        stage.set_input_tensor(x)
        output, loss_func = self.forward_step_func(self.data_iterator[c.chunk], stage)
        if c.loss:
            loss, reported = loss_func(output)
            self.losses[c.microbatch] = reported
            output = loss / self.m
        return output

    def backward(self, c: Compute, synced: tuple[int, ...] = ()) -> None:
        grad = None if c.needs is None else self._take(c.needs)
        if c.op == "I":  # the chunk's linear layers defer their weight grads to W
            if self.timeline is None:
                with self.stores[c.chunk].defer(c.key):
                    input_grad = self._backward(c, grad)
            else:
                with self.timeline.span(c.label), self.stores[c.chunk].defer(c.key):
                    input_grad = self._backward(c, grad)
        elif self.timeline is not None:
            with self.timeline.span(c.label):
                input_grad = self._backward(c, grad)
        else:  # the hot path: no context to enter
            input_grad = self._backward(c, grad)
        if c.hands is not None:
            self.mailbox[c.hands] = input_grad
        elif c.sends:
            self.input_grads[c.key] = input_grad

    def _backward(self, c: Compute, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The backward of ``c``'s micro-batch, and its input's grad (None on stage 0): the
        model's whole backward, in the B / I span, the release of its graph (the last reference
        to the output, dropped on return) included, as torch's schedules pay it too."""
        x, output = self.held.pop(c.key)
        if grad is None:  # the loss stage: the output is the scaled loss
            if self.grad_scale_func is not None:
                output = self.grad_scale_func(output)
            output.backward()
        else:
            run_freed_backward(tensors=(output,), grad_tensors=(grad,))
        return None if x is None else x.grad

    def weight(self, c: Compute, synced: tuple[int, ...] = ()) -> None:
        if self.timeline is None:
            self.stores[c.chunk].flush(c.key)
            return
        with self._span(c):
            self.stores[c.chunk].flush(c.key)

    # --- the list -----------------------------------------------------------------------------

    def run(self, plan: Plan) -> list[dict]:
        if plan.defers:  # only an I defers weight grads: nothing to attach without one
            self.stores = [WeightGradStore() for _ in self.modules]
            for module, store in zip(self.modules, self.stores):
                attach_weight_grad_store(module, store)
        # indexed by the item's code (F, BACKWARD, W, POST); through ``_step`` where a compute
        # is recorded, runs inside no_sync, or (forward-only) B / I / W are skipped
        if self.recording or self.wrapped or self.forward_only:
            handlers = (self._step, self._step, self._step, self._post)
        else:
            handlers = (self.forward, self.backward, self.weight, self._post)
        sends = self.sends
        try:
            if self.p2p.device.type == "cpu":  # gloo: a send is done only once waited for
                for code, item, extra in plan.items:
                    handlers[code](item, extra)
            else:  # release a sent output as soon as the backend reports the send done
                for code, item, extra in plan.items:
                    if sends and sends[0][0].is_completed():
                        self._poll_sends()
                    handlers[code](item, extra)
            self._wait_sends()
        finally:
            for module in self.modules:  # each F sets its input; none is kept past the step
                module.set_input_tensor(None)
            if plan.defers:
                for module in self.modules:
                    attach_weight_grad_store(module, None)
        if plan.defers and any(s.pending() for s in self.stores):
            raise RuntimeError("the action list left weight grads queued: an I without its W")
        losses = self.losses
        return [losses[mb] for mb in sorted(losses)]

    def _step(self, c: Compute, synced: tuple[int, ...]) -> None:
        """Run compute action ``c``, recorded; ``synced``: the chunks it runs inside ``no_sync``
        (B, I, W)."""
        rec = None
        if self.recording:
            rec = RECORDER.begin(
                "compute",
                stage=self.layout.stage(self.rank, c.chunk),
                microbatch=c.microbatch,
                action=c.op,
                chunk=c.chunk,
            )
        if c.op == "F":
            self.forward(c)
        elif not self.forward_only:  # B, I or W
            run = self.weight if c.op == "W" else self.backward
            held = [self.model[k] for k in synced if k in self.wrapped] if self.wrapped else None
            if held:
                with no_sync(held):
                    run(c)
            else:
                run(c)
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
