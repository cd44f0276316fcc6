"""Stage-to-stage communication: activations forward, their grads backward, between adjacent stages.

Shapes are known ahead (``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallel) and the dtype
is the run's, so the receiver preallocates and no shape travels with each message. What could go
wrong is checked instead of hanging:
- on first use, neighbours exchange the (shape, dtype) each will send and compare it with what the
  other expects; a mismatch raises the same one-line error on both stages;
- every send checks the tensor against the declared shape and dtype before it leaves.
Paired operations (send one way, receive the other) are issued together with ``batch_isend_irecv``
so two neighbours calling them at the same time cannot deadlock; this works on gloo and nccl.

The action-list executor (``executor.py``) uses the same object for its batched, asynchronous
sends and receives between any two stages of the pipeline: ``pp_ranks`` (the global ranks of the
pipeline group in stage order) lets it reach non-neighbours (the wrap-around of an interleaved
schedule), ``overlap`` says whether a posted receive may wait until its consumer runs
(``--no-overlap-p2p-communication`` turns it off), ``tagged=False`` posts every message with tag
0: matched by posting order alone, as nccl matches them (a test mode for gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class StageShapeMismatch(RuntimeError):
    pass


class P2PCommunicator:
    """Send/receive between this stage and its neighbours in the pipeline.

    ``prev_rank`` / ``next_rank`` are global ranks (None at the ends of the pipeline). Receives
    return None where there is no neighbour, so a schedule reads the same on every stage.
    """

    def __init__(
        self,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        group,
        timeline=None,
        pp_ranks: list[int] | None = None,
        overlap: bool = True,
        tagged: bool = True,
    ):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.pp_ranks, self.overlap = (list(pp_ranks) if pp_ranks else None), overlap
        self.tagged = tagged
        self.shape, self.dtype, self.device = tuple(tensor_shape), dtype, device
        self.group = group
        self.timeline = timeline
        self._checked = False

    # --- the consistency check --------------------------------------------------------------------

    def _spec(self) -> torch.Tensor:
        code = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else 99
        return torch.tensor([len(self.shape), *self.shape, code] + [0] * (8 - len(self.shape)))

    def _describe(self, spec: torch.Tensor) -> str:
        n = int(spec[0])
        shape = tuple(int(v) for v in spec[1 : 1 + n])
        code = int(spec[1 + n])
        dtype = _DTYPES[code] if code < len(_DTYPES) else "unknown"
        return f"{list(shape)} {dtype}"

    def check_neighbours(self) -> None:
        """Exchange (shape, dtype) with both neighbours once; raise on any disagreement."""
        if self._checked:
            return
        self._checked = True
        mine = self._spec().to(self.device)
        ops, received = [], {}
        for peer in (self.prev_rank, self.next_rank):
            if peer is None:
                continue
            buf = torch.empty_like(mine)
            received[peer] = buf
            ops.append(dist.P2POp(dist.isend, mine, peer, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
        self._run(ops)
        for peer, spec in received.items():
            if not torch.equal(spec.cpu(), mine.cpu()):
                first, second = sorted([dist.get_rank(), peer])
                a, b = (mine, spec) if dist.get_rank() == first else (spec, mine)
                raise StageShapeMismatch(
                    f"pipeline stages disagree on the activation passed between ranks {first} and "
                    f"{second}: {self._describe(a)} vs {self._describe(b)}; every stage must use "
                    "the same seq_length, micro_batch_size, hidden_size, sequence_parallel and "
                    "params dtype"
                )

    def global_rank(self, target: int, me: int) -> int:
        """Global rank of pipeline rank ``target``, seen from pipeline rank ``me``."""
        if self.pp_ranks is not None:
            return self.pp_ranks[target]
        if target == me - 1 and self.prev_rank is not None:
            return self.prev_rank
        if target == me + 1 and self.next_rank is not None:
            return self.next_rank
        raise ValueError(
            f"pipeline rank {me} must reach rank {target}, which is not a neighbour: build the "
            "P2PCommunicator with pp_ranks"
        )

    def empty(self) -> torch.Tensor:
        """A receive buffer of the declared shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def validate(self, t: torch.Tensor, what: str) -> None:
        self._validate(t, what)

    def _validate(self, t: torch.Tensor, what: str) -> None:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise StageShapeMismatch(
                f"{what}: tensor is {list(t.shape)} {t.dtype} but the pipeline was set up for "
                f"{list(self.shape)} {self.dtype}"
            )

    # --- primitives ------------------------------------------------------------------------------

    def _run(self, ops: list) -> None:
        if not ops:
            return
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def _communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        label: str,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.check_neighbours()
        ops = []
        from_prev = from_next = None
        if send_next is not None and self.next_rank is not None:
            self._validate(send_next, "send to the next stage")
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next_rank, self.group))
        if send_prev is not None and self.prev_rank is not None:
            self._validate(send_prev, "send to the previous stage")
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev_rank, self.group))
        if recv_prev and self.prev_rank is not None:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group))
        if recv_next and self.next_rank is not None:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group))
        if ops and self.timeline is not None:
            with self.timeline.span(label):
                self._run(ops)
        else:
            self._run(ops)
        return from_prev, from_next

    # --- what schedules call ----------------------------------------------------------------------

    def recv_forward(self) -> torch.Tensor | None:
        """The previous stage's output activation (None on the first stage)."""
        return self._communicate(recv_prev=True, label="recv")[0]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self._communicate(send_next=output, label="send")

    def recv_backward(self) -> torch.Tensor | None:
        """The grad of this stage's output from the next stage (None on the last stage)."""
        return self._communicate(recv_next=True, label="recv")[1]

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self._communicate(send_prev=input_grad, label="send")

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return self._communicate(send_next=output, recv_next=True, label="send+recv")[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._communicate(send_prev=input_grad, recv_prev=True, label="send+recv")[0]
