"""Stage-to-stage communication: activations forward, their grads backward, between pipeline stages.

Shapes are known ahead (``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallel) and the dtype
is the run's, so the receiver preallocates and no shape travels with each message. What could go
wrong is checked instead of hanging:
- on first use, neighbours exchange the (shape, dtype) each will send and compare it with what the
  other expects; a mismatch raises the same one-line error on both stages;
- every send checks the tensor against the declared shape and dtype before it leaves.

The executor (``executor.py``) posts its sends and receives itself, batched and asynchronous; this
object holds what they share for a run: the group, the declared shape and dtype, ``pp_ranks`` (the
global ranks of the pipeline group in stage order: an interleaved schedule's wrap-around reaches a
non-neighbour), ``overlap`` (whether a posted receive may wait until its consumer runs),
``tagged`` (False posts every message with tag 0: matched by posting order alone, as nccl matches
them; a test mode for gloo), ``batched`` (how ``post`` posts a batch: one ``batch_isend_irecv``,
which nccl coalesces into one grouped launch; or, where the backend posts a batch op by op anyway
(gloo: what ``batch_isend_irecv`` does there), each op straight on the process group, without the
per-op Python checks; the default: batched unless the device is the CPU), the pool of receive
buffers (``ReceiveBuffers``), ``receive_lead`` (how many batches early the executor posts each
receive: ``RECEIVE_LEAD`` where messages are matched by tag, posted op by op and waited for by
their consumers, else 0). It also hands the losses to the last rank when the loss stage lives
elsewhere (``losses_to_last_rank``), by the names it keeps in ``loss_names``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from megalite.core.op_record import RECORDER
from megalite.core.pipeline_parallel.actions import StageLayout

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class StageShapeMismatch(RuntimeError):
    pass


# how many batches ahead of ``p2p_program``'s place a tag-matched, op-by-op communicator posts a
# receive by default (``posting.receives_ahead``). ``tools/bench/bench_receive_lead.py`` on 2 CPU
# cores, medians of 3 runs per schedule: at PP 4 (ranks share the cores) lead 2 made the steps
# 6-14% shorter than lead 0 and 2-8% shorter than lead 1; at PP 2 (a core per rank, so a late
# receive's sender finds a free core) 0.91-1.02x lead 0
RECEIVE_LEAD = 2

# the counts telling whether anything but the pool holds a buffer (old torch lacks them: no reuse)
_CAN_REUSE = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")


class ReceiveBuffers:
    """Receive buffers of one shape and dtype, reused once nothing but this pool holds them.

    A received activation becomes the input of a forward: the autograd graph saves it (or a view
    of it) until the micro-batch's backward (or its W) is done, the stage's own code may keep it,
    and the grad received for an output may be kept by a ``WeightGradStore`` until W. So a buffer
    is handed out again only when no Python reference but the pool's, no other holder of its
    tensor (a saved variable) and no other tensor on its storage (a view) remain; otherwise a new
    one is allocated. Steps of one schedule then receive into the same few buffers (as many as the
    step ever held at once). ``allocated``: buffers made so far."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.buffers: list[torch.Tensor] = []
        self.allocated = 0
        for probe in [torch.empty(0)]:  # the same loop as ``take``'s: the pool's reference alone
            self._alone = sys.getrefcount(probe)

    def take(self) -> torch.Tensor:
        """A buffer of the declared shape and dtype for a receive: a free one, else a new one.
        Free: no Python reference but the pool's (and this loop's), the tensor held by its
        Python object alone (no saved variable), its storage by the tensor alone (no view; the
        ``storage`` local is the second holder)."""
        if _CAN_REUSE:
            alone = self._alone
            for buf in self.buffers:
                if sys.getrefcount(buf) > alone or buf._use_count() != 1:
                    continue
                storage = buf.untyped_storage()
                if torch._C._storage_Use_Count(storage._cdata) != 2:
                    continue
                if buf.requires_grad:  # it was a forward's input: a fresh leaf again
                    buf.grad = None
                    buf.requires_grad_(False)
                return buf
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.allocated += 1
        if _CAN_REUSE:
            self.buffers.append(buf)
        return buf


class _AllOf:
    """The works of a batch as one (nccl returns one work per batch, gloo one per op)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self):
        for w in self.works:
            w.wait()

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


class P2PCommunicator:
    """What the pipeline stages of one run exchange, and with whom.

    ``prev_rank`` / ``next_rank`` are global ranks (None at the ends of the pipeline).
    ``loss_names``: the names of the loss dict, once known. A V layout computes the loss on
    pipeline rank 0 and hands the values to the last rank by name; the names travel in the first
    step only (a host read) and are kept here for the run's later steps.
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
        pp_ranks: list[int] | None = None,
        overlap: bool = True,
        tagged: bool = True,
        batched: bool | None = None,
        receive_lead: int | None = None,
    ):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.pp_ranks, self.overlap = (list(pp_ranks) if pp_ranks else None), overlap
        self.tagged = tagged
        self.shape, self.dtype, self.device = tuple(tensor_shape), dtype, device
        self.group = group
        self.loss_names: list[str] | None = None
        self._checked = False
        self.batched = device.type != "cpu" if batched is None else batched
        # receives may go ahead of p2p_program's place only where nothing pairs batches up or
        # waits for them at posting: matched by tag, posted op by op, waited for by consumers
        ahead_ok = tagged and not self.batched and overlap
        if receive_lead is None:
            receive_lead = RECEIVE_LEAD if ahead_ok else 0
        elif receive_lead < 0 or (receive_lead and not ahead_ok):
            raise ValueError(
                f"receive_lead={receive_lead}: receives can be posted ahead (a lead >= 1) only "
                "by a communicator that matches messages by tag, posts op by op and lets "
                f"consumers wait (tagged=True, batched=False, overlap=True; got tagged={tagged}, "
                f"batched={self.batched}, overlap={overlap}); pass receive_lead=0 or None"
            )
        self.receive_lead = receive_lead
        self.receive_buffers = ReceiveBuffers(self.shape, dtype, device)
        self._group_ranks: dict[int, int] = {}  # global rank -> rank in ``group`` (``post``)
        # the executor's resolved posting plans of this run's programs (``executor.plan_for``)
        self.plans: dict = {}

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
        if ops:
            rec = RECORDER.begin(
                "shape exchange", group=self.group, axis="pp", what="activation shape and dtype"
            )
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            RECORDER.end(rec)
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

    def post(self, batch: list[tuple[bool, torch.Tensor, int, int]]) -> list:
        """Post ``batch``, ``(send, tensor, global peer, tag)`` in that order, as one batch; a work
        per op (a batch's one work, repeated, where nccl returns one)."""
        if self.batched:
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend if send else dist.irecv, t, peer, self.group, tag)
                    for send, t, peer, tag in batch
                ]
            )
            return works if len(works) == len(batch) else [_AllOf(works)] * len(batch)
        works = []
        for send, t, peer, tag in batch:  # batch_isend_irecv's loop on such a backend
            call, group_rank = self.direct(send, peer)
            works.append(call([t], group_rank, tag))
        return works

    def direct(self, send: bool, peer: int) -> tuple[Callable | None, int]:
        """Where a batch is posted op by op (not ``batched``): the process group's own ``send``
        or ``recv`` for a message to or from global rank ``peer``, and the peer's rank in the
        group; ``call([tensor], group_rank, tag)`` posts the op as ``post`` does, without
        ``dist.isend``'s per-call checks. ``(None, -1)`` where ``post`` batches."""
        if self.batched:
            return None, -1
        group = self.group if self.group is not None else dist.group.WORLD
        if peer not in self._group_ranks:
            self._group_ranks[peer] = dist.get_group_rank(group, peer)
        return (group.send if send else group.recv), self._group_ranks[peer]

    def validate(self, t: torch.Tensor, what: str) -> None:
        """A one-line StageShapeMismatch unless ``t`` has the declared shape and dtype."""
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise StageShapeMismatch(
                f"{what}: tensor is {list(t.shape)} {t.dtype} but the pipeline was set up for "
                f"{list(self.shape)} {self.dtype}"
            )

    # --- the losses of a layout whose loss stage is not on the last rank ------------------------

    def losses_to_last_rank(
        self, losses: list[dict], layout: StageLayout, pp_rank: int, num_microbatches: int
    ) -> list[dict]:
        """The per-micro-batch loss dicts on the last pipeline rank, [] elsewhere. ``losses``:
        what this rank computed ([] off the loss stage's rank). When the loss stage lives on
        another rank (a V: rank 0) it sends the values, by ``loss_names``, to the last rank."""
        src, dst = layout.loss_rank(), layout.pp_size - 1
        if src == dst:
            return losses if pp_rank == dst else []
        if pp_rank == src:
            self._send_losses(losses, self.global_rank(dst, pp_rank))
            return []
        if pp_rank == dst:
            return self._recv_losses(self.global_rank(src, pp_rank), num_microbatches)
        return []

    def _send_losses(self, losses: list[dict], to: int) -> None:
        names = list(losses[0]) if losses else []
        if self.loss_names is not None and names != self.loss_names:
            raise RuntimeError(
                f"the loss function returned {names} after {self.loss_names} in an earlier step; "
                "a V pipeline layout hands the losses over by name, so keep the names fixed"
            )
        if self.loss_names is None:  # the first step: the names, once (a host read)
            header = torch.tensor([len(names)], dtype=torch.int64, device=self.device)
            dist.send(header, to, group=self.group)
            if names:  # send_object_list cannot send an empty list
                dist.send_object_list(names, to, group=self.group)
            self.loss_names = names
        if names:
            values = torch.stack(
                [torch.stack([d[n].detach().float().reshape(()) for n in names]) for d in losses]
            )  # [num_microbatches, num_names]
            rec = RECORDER.begin("send", axis="pp", what="losses", peer=to, shape=values.shape)
            dist.send(values.to(self.device), to, group=self.group)
            RECORDER.end(rec)

    def _recv_losses(self, src: int, num_microbatches: int) -> list[dict]:
        if self.loss_names is None:  # the first step: the names, once
            header = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(header, src, group=self.group)
            names = [None] * int(header)
            if names:
                dist.recv_object_list(names, src, group=self.group)
            self.loss_names = names
        names = self.loss_names
        if not names:  # nothing reported: the last rank gets one empty dict per micro-batch
            return [{} for _ in range(num_microbatches)]
        values = torch.empty(num_microbatches, len(names), dtype=torch.float32, device=self.device)
        rec = RECORDER.begin("recv", axis="pp", what="losses", peer=src, shape=values.shape)
        dist.recv(values, src, group=self.group)
        RECORDER.end(rec)
        return [dict(zip(names, row.unbind(0))) for row in values]
