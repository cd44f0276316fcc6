"""Run one rank's action list (``actions.py``): the one executor behind every schedule.

    losses = execute(lists[pp_rank], layout=layout, pp_rank=r, forward_step_func=..., model=[...],
                     data_iterator=[...], num_microbatches=m, p2p=p2p)

Per (micro-batch, chunk) it keeps the input received (or handed over by the previous chunk of the
same rank, at the turn of a V), the output, and the grad of the output. F runs
``forward_step_func(data_iterator[c], model[c])`` after ``set_input_tensor``; on the stage that
holds the loss it applies ``loss_func``, divides by ``num_microbatches`` (and applies
``grad_scale_func`` before backward). B runs the backward; I runs it with the chunk's linear
layers deferring their weight grads into a ``WeightGradStore`` keyed by the micro-batch; W
computes them. Sends are asynchronous (the storage of a sent output is freed once the send is
done, keeping its autograd node); a RECV posts the receive and the consumer waits for it, so any
list that the simulator can replay runs without deadlock. Messages carry a tag per (direction,
micro-batch, stage), so they match whatever order the lists post them in.

Grad sync: every compute action runs inside the ``no_sync()`` of every chunk except the chunks for
which it is the last action touching their grads (their last B, I or W of the step), so the
data-parallel wrappers learn each parameter's last micro-batch from the schedule.

Losses are returned on the last pipeline rank (as for 1F1B), also when the loss stage lives on
another rank (a V layout computes it on rank 0): the loss rank sends them over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from megalite.core.pipeline_parallel.actions import Action, StageLayout
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import WeightGradStore, attach_weight_grad_store

_LABEL = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def unwrap(model: nn.Module) -> nn.Module:
    """The module under the wrappers of one chunk (the one with ``set_input_tensor``)."""
    while not hasattr(model, "set_input_tensor") and hasattr(model, "module"):
        model = model.module
    return model


def free_output_storage(output: torch.Tensor | None) -> None:
    """After an activation is sent, keep its autograd node but drop its data: the next stage has a
    copy, and backward needs only the node. Saves one ``[s, b, h]`` per in-flight micro-batch."""
    if output is not None and output.grad_fn is not None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def backward_freed_output(output: torch.Tensor, grad: torch.Tensor) -> None:
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


def no_sync(model: Sequence[nn.Module]) -> contextlib.ExitStack:
    """Every chunk's ``no_sync()`` at once (chunks without one are skipped)."""
    stack = contextlib.ExitStack()
    for chunk in model:
        chunk_no_sync = getattr(chunk, "no_sync", None)
        if chunk_no_sync is not None:
            stack.enter_context(chunk_no_sync())
    return stack


class _SharedBatches:
    """Chunks given the same iterator each see every micro-batch once: the first to ask reads
    it, the others replay it."""

    def __init__(self, source: Iterator, readers: int):
        self.source, self.readers = source, readers
        self.cache: dict[int, list] = {}  # index -> [item, readers left]
        self.read = 0

    def view(self) -> Iterator:
        index = 0
        while True:
            if index == self.read:
                self.cache[index] = [next(self.source), self.readers]
                self.read += 1
            entry = self.cache[index]
            entry[1] -= 1
            if entry[1] == 0:
                del self.cache[index]
            yield entry[0]
            index += 1


def per_chunk_iterators(data_iterator: Sequence[Iterator | None]) -> list[Iterator | None]:
    groups: dict[int, list[int]] = {}
    for c, it in enumerate(data_iterator):
        if it is not None:
            groups.setdefault(id(it), []).append(c)
    out = list(data_iterator)
    for chunks in groups.values():
        if len(chunks) > 1:
            shared = _SharedBatches(data_iterator[chunks[0]], len(chunks))
            for c in chunks:
                out[c] = shared.view()
    return out


class _Run:
    def __init__(
        self, *, layout, pp_rank, forward_step_func, model, data_iterator, num_microbatches,
        p2p, forward_only, grad_scale_func, timeline,
    ):  # fmt: skip
        self.layout, self.rank = layout, pp_rank
        self.forward_step_func, self.model = forward_step_func, list(model)
        self.data_iterator = per_chunk_iterators(data_iterator)
        self.m, self.p2p = num_microbatches, p2p
        self.forward_only, self.grad_scale_func = forward_only, grad_scale_func
        self.timeline = timeline
        S = layout.num_stages
        self.stages = [layout.stage(pp_rank, c) for c in range(len(self.model))]
        self.is_loss = [s == S - 1 for s in self.stages]
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, stage)
        self.recvs: dict[tuple[str, int, int], tuple[object, torch.Tensor]] = {}
        self.sends: list[tuple[object, torch.Tensor | None]] = []
        self.to_send: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, dict] = {}
        self.stores = [WeightGradStore() for _ in self.model]

    # --- communication ------------------------------------------------------------------------

    def _tag(self, kind: str, mb: int, stage: int) -> int:
        return (0 if kind == "F" else 1) + 2 * (stage + self.layout.num_stages * mb)

    def _peer(self, stage: int) -> int:
        return self.p2p.global_rank(self.layout.place(stage)[0], self.rank)

    def _poll_sends(self, wait: bool = False) -> None:
        keep = []
        for work, tensor in self.sends:
            if wait:
                work.wait()
            if wait or work.is_completed():
                free_output_storage(tensor)
            else:
                keep.append((work, tensor))
        self.sends = keep

    def _send(self, kind: str, tensor: torch.Tensor, mb: int, to_stage: int, free=None) -> None:
        self.p2p.validate(tensor, "send to the next stage" if kind == "F" else "send back")
        work = dist.isend(
            tensor.detach().contiguous(), self._peer(to_stage), group=self.p2p.group,
            tag=self._tag(kind, mb, to_stage),
        )  # fmt: skip
        self.sends.append((work, free))

    def _post_recv(self, kind: str, mb: int, stage: int) -> None:
        from_stage = stage - 1 if kind == "F" else stage + 1
        buf = self.p2p.empty()
        work = dist.irecv(
            buf, self._peer(from_stage), group=self.p2p.group, tag=self._tag(kind, mb, stage)
        )
        self.recvs[(kind, mb, stage)] = (work, buf)

    def _take(self, kind: str, mb: int, stage: int) -> torch.Tensor:
        key = (kind, mb, stage)
        if key in self.mailbox:
            return self.mailbox.pop(key)
        if key not in self.recvs:
            self._post_recv(kind, mb, stage)
        work, buf = self.recvs.pop(key)
        label = "recv" if self.timeline is not None else None
        with self.timeline.span(label) if label else contextlib.nullcontext():
            work.wait()
        return buf

    # --- compute ------------------------------------------------------------------------------

    def _span(self, a: Action):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(f"{_LABEL[a.op]} {a.microbatch}.{a.chunk}")

    def forward(self, a: Action) -> None:
        mb, c = a.microbatch, a.chunk
        s = self.stages[c]
        x = None if s == 0 else self._take("F", mb, s)
        if x is not None and not self.forward_only:
            x.requires_grad_()
        grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with self._span(a), grad_ctx:
            unwrap(self.model[c]).set_input_tensor(x)
            output, loss_func = self.forward_step_func(self.data_iterator[c], self.model[c])
            if self.is_loss[c]:
                loss, reported = loss_func(output)
                self.losses[mb] = reported
                output = loss / self.m
        unwrap(self.model[c]).set_input_tensor(None)
        if not self.forward_only:
            self.inputs[(mb, c)] = x
            self.outputs[(mb, c)] = output
        if s < self.layout.num_stages - 1:
            if self.layout.place(s + 1)[0] == self.rank:  # the turn of a V: same rank
                self.mailbox[("F", mb, s + 1)] = output.detach()
            else:
                self.to_send[(mb, c)] = output

    def backward(self, a: Action) -> None:
        mb, c = a.microbatch, a.chunk
        s = self.stages[c]
        x, output = self.inputs.pop((mb, c)), self.outputs.pop((mb, c))
        grad = None if self.is_loss[c] else self._take("B", mb, s)
        defer = self.stores[c].defer((mb, c)) if a.op == "I" else contextlib.nullcontext()
        with self._span(a), defer:
            if grad is None:  # the loss stage: the output is the scaled loss
                if self.grad_scale_func is not None:
                    output = self.grad_scale_func(output)
                output.backward()
            else:
                backward_freed_output(output, grad)
        input_grad = None if x is None else x.grad
        if s > 0 and self.layout.place(s - 1)[0] == self.rank:
            self.mailbox[("B", mb, s - 1)] = input_grad
        else:
            self.input_grads[(mb, c)] = input_grad

    def weight(self, a: Action) -> None:
        with self._span(a):
            self.stores[a.chunk].flush((a.microbatch, a.chunk))

    # --- the list -----------------------------------------------------------------------------

    def run(self, actions: list[Action]) -> list[dict]:
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.op in ("B", "I", "W"):
                last[a.chunk] = i
        for c, chunk in enumerate(self.model):
            attach_weight_grad_store(unwrap(chunk), self.stores[c])
        try:
            for i, a in enumerate(actions):
                self._poll_sends()
                self._step(i, a, last)
            self._poll_sends(wait=True)
        finally:
            for chunk in self.model:
                attach_weight_grad_store(unwrap(chunk), None)
        if any(s.pending() for s in self.stores):
            raise RuntimeError("the action list left weight grads queued: an I without its W")
        return [self.losses[mb] for mb in sorted(self.losses)]

    def _step(self, i: int, a: Action, last: dict[int, int]) -> None:
        mb, c = a.microbatch, a.chunk
        s = self.stages[c]
        if a.op == "F":
            self.forward(a)
        elif a.op in ("B", "I", "W"):
            if self.forward_only:
                return
            synced = [chunk for k, chunk in enumerate(self.model) if last.get(k) != i]
            with no_sync(synced):
                (self.weight if a.op == "W" else self.backward)(a)
        elif a.op == "SEND_F":
            output = self.to_send.pop((mb, c))
            self._send("F", output, mb, s + 1, free=output)
        elif a.op == "SEND_B":
            self._send("B", self.input_grads.pop((mb, c)), mb, s - 1)
        elif a.op == "RECV_F":
            self._post_recv("F", mb, s)
            if not self.p2p.overlap:
                self._take_into_mailbox("F", mb, s)
        elif a.op == "RECV_B":
            if self.forward_only:
                return
            self._post_recv("B", mb, s)
            if not self.p2p.overlap:
                self._take_into_mailbox("B", mb, s)

    def _take_into_mailbox(self, kind: str, mb: int, stage: int) -> None:
        self.mailbox[(kind, mb, stage)] = self._take(kind, mb, stage)


def execute(
    actions: list[Action],
    *,
    layout: StageLayout,
    pp_rank: int,
    forward_step_func: Callable,
    model: list[nn.Module],
    data_iterator: list[Iterator | None],
    num_microbatches: int,
    p2p: P2PCommunicator,
    forward_only: bool = False,
    grad_scale_func: Callable | None = None,
    timeline: Timeline | None = None,
) -> list[dict]:
    """Run ``actions`` (this rank's list); returns the per-micro-batch loss dicts on the last
    pipeline rank, [] elsewhere."""
    if len(model) != layout.num_chunks or len(data_iterator) != layout.num_chunks:
        raise ValueError(
            f"the schedule runs {layout.num_chunks} model chunk(s) per rank, got {len(model)} "
            f"chunks and {len(data_iterator)} data iterators"
        )
    p2p.check_neighbours()
    run = _Run(
        layout=layout, pp_rank=pp_rank, forward_step_func=forward_step_func, model=model,
        data_iterator=data_iterator, num_microbatches=num_microbatches, p2p=p2p,
        forward_only=forward_only, grad_scale_func=grad_scale_func, timeline=timeline,
    )  # fmt: skip
    losses = run.run(actions)
    return _losses_to_last_rank(losses, layout, pp_rank, p2p, num_microbatches)


def _losses_to_last_rank(losses, layout, pp_rank, p2p, m) -> list[dict]:
    src, dst = layout.loss_rank(), layout.pp_size - 1
    if src == dst:
        return losses if pp_rank == dst else []
    if pp_rank not in (src, dst):
        return []
    # the loss names travel once per run (a host read), then are kept on the communicator
    known = getattr(p2p, "loss_names", None)
    if pp_rank == src:
        names = list(losses[0]) if losses else []
        if known is not None and names != known:
            raise RuntimeError(
                f"the loss function returned {names} after {known} in an earlier step; a V "
                "pipeline layout hands the losses over by name, so keep the names fixed"
            )
        if known is None:
            header = torch.tensor([len(names)], dtype=torch.int64, device=p2p.device)
            dist.send(header, p2p.global_rank(dst, pp_rank), group=p2p.group)
            if names:  # send_object_list cannot send an empty list
                dist.send_object_list(names, p2p.global_rank(dst, pp_rank), group=p2p.group)
            p2p.loss_names = names
        if names:
            values = torch.stack(
                [torch.stack([d[n].detach().float().reshape(()) for n in names]) for d in losses]
            )
            dist.send(values.to(p2p.device), p2p.global_rank(dst, pp_rank), group=p2p.group)
        return []
    names = known
    if names is None:
        header = torch.zeros(1, dtype=torch.int64, device=p2p.device)
        dist.recv(header, p2p.global_rank(src, pp_rank), group=p2p.group)
        names = [None] * int(header)
        if names:
            dist.recv_object_list(names, p2p.global_rank(src, pp_rank), group=p2p.group)
        p2p.loss_names = names
    if not names:  # nothing reported: the last rank gets m empty dicts
        return [{} for _ in range(m)]
    values = torch.empty(m, len(names), dtype=torch.float32, device=p2p.device)
    dist.recv(values, p2p.global_rank(src, pp_rank), group=p2p.group)
    return [dict(zip(names, row.unbind(0))) for row in values]
