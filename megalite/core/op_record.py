"""A per-rank ring of the communication a rank issues and what each message is for, so that a hang
can be explained (``hang_watchdog.py`` publishes it, ``hang_report.py`` reads every rank's).

    RECORDER.enable(capacity=256)          # off by default: every call below returns at once
    rec = RECORDER.begin("all_reduce", group=g, axis="dp", what="grad bucket 0", shape=(1024,))
    dist.all_reduce(x, group=g)
    RECORDER.end(rec)

A record holds the op (``send``, ``recv``, ``all_reduce``, ... or ``compute`` for a pipeline
action), the mesh axis, what the message is for (``activation``, ``grad``, ``grad bucket 3``), the
pipeline stage, micro-batch, action (F/B/I/W) and chunk, the peer (global rank) of a p2p message,
the shape, and its sequence number on its channel: one counter per process group for collectives
(the channel ``("group", group name, *global ranks)``),
one per (sender, receiver) pair for p2p messages, so the n-th op of one rank can be set beside the
n-th op of the others. A collective issued inside a pipeline action takes its stage, micro-batch
and action from that action's record.

States: ``posted`` (an asynchronous op started, nobody waits on it yet), ``waiting`` (the main
thread waits on it: ``current`` points at it), ``done``. ``current`` is what the main thread is
inside now, a collective or a pipeline action, or None between them; the watchdog reads it.

Why a process-wide instance and not a parameter: the recorder is a diagnostic every communication
site reports to, like a logger; threading it through every layer would add an argument to every
collective for a feature that is off unless a timeout is asked for. When off, ``begin`` / ``post``
return None after one attribute check and allocate nothing.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist


class OpRecord:
    """One op (see the module docstring); ``as_dict`` is what a rank publishes."""

    __slots__ = (
        "index",
        "op",
        "axis",
        "what",
        "peer",
        "shape",
        "channel",
        "seq",
        "stage",
        "microbatch",
        "action",
        "chunk",
        "t_begin",
        "t_wait",
        "t_end",
        "state",
        "parent",
    )

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "parent"}
        out["channel"] = list(self.channel) if self.channel is not None else None
        out["shape"] = list(self.shape) if self.shape is not None else None
        return out


def _shape(shape) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(d) for d in shape)


def _recording(state: str, doc: str):
    """``OpRecorder.begin`` / ``post``: the one signature of a recorded op; the two differ only in
    the state the record starts in. When off: one attribute check, nothing allocated."""

    def record(
        self: OpRecorder,
        op: str,
        *,
        group=None,
        axis: str | None = None,
        what: str | None = None,
        peer: int | None = None,
        shape=None,
        stage: int | None = None,
        microbatch: int | None = None,
        action: str | None = None,
        chunk: int | None = None,
    ) -> OpRecord | None:
        if not self.enabled:
            return None
        rec = OpRecord()
        parent = self.current if self.current is not None and op != "compute" else None
        rec.op, rec.axis, rec.what, rec.peer, rec.shape = op, axis, what, peer, _shape(shape)
        rec.stage = stage if stage is not None or parent is None else parent.stage
        rec.microbatch = (
            microbatch if microbatch is not None or parent is None else parent.microbatch
        )
        rec.action = action if action is not None or parent is None else parent.action
        rec.chunk = chunk if chunk is not None or parent is None else parent.chunk
        rec.channel = self._channel(op, group, peer)
        rec.t_begin = time.time()
        rec.t_wait = rec.t_begin if state == "waiting" else None
        rec.t_end, rec.state, rec.parent = None, state, None
        with self.lock:
            rec.seq = self._seq.get(rec.channel, 0)
            self._seq[rec.channel] = rec.seq + 1
            rec.index = self.count
            self.ring[self.count % self.capacity] = rec
            self.count += 1
            if state == "waiting":
                rec.parent, self.current = self.current, rec
        return rec

    record.__doc__ = doc
    return record


class OpRecorder:
    """The ring of this rank's last ``capacity`` records; ``enabled`` False records nothing."""

    def __init__(self) -> None:
        self.enabled = False
        self.capacity = 0
        self.ring: list[OpRecord | None] = []
        self.count = 0  # records ever made (the ring keeps the last ``capacity``)
        self.current: OpRecord | None = None
        self.coords: dict[str, int] = {}  # this rank's place in the mesh, e.g. {"pp": 1, "dp": 0}
        self.rank = 0
        self.comm_wait_s = 0.0  # seconds the main thread waited on communication, ever
        self._seq: dict[tuple, int] = {}
        # id(group) -> (group, key); the group is held so its id cannot be reused by a new group
        # while the entry lives (a stale key would name the wrong ranks)
        self._group_keys: dict[int, tuple[object, tuple]] = {}
        self.lock = threading.Lock()  # the watchdog's snapshot against the main thread's writes

    def enable(self, capacity: int = 256, *, rank: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.enabled, self.capacity = True, capacity
        self.ring, self.count, self.current, self._seq = [None] * capacity, 0, None, {}
        self._group_keys = {}
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)

    def disable(self) -> None:
        self.enabled, self.ring, self.current, self.capacity = False, [], None, 0
        self._group_keys = {}

    # --- recording ---------------------------------------------------------------------------

    def _channel(self, op: str, group, peer: int | None) -> tuple:
        if op == "compute":
            return ("compute",)
        if op in ("send", "recv"):
            src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
            return ("p2p", src, dst)
        cached = self._group_keys.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1]
        # the group's name tells apart two groups of the same ranks
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        key = ("group", group.group_name if group is not None else "", *ranks)
        self._group_keys[id(group)] = (group, key)
        return key

    begin = _recording(
        "waiting",
        """A blocking op (or a pipeline action, ``op="compute"``) starts: the main thread is in
        it until ``end``. None when off.""",
    )
    post = _recording(
        "posted",
        """An asynchronous op is posted; ``wait`` when the main thread blocks on it, ``end``
        when it is done. None when off.""",
    )

    def wait(self, rec: OpRecord | None) -> None:
        """The main thread now blocks on ``rec`` (a posted op)."""
        if rec is None or rec.state != "posted":
            return
        with self.lock:
            rec.state, rec.t_wait = "waiting", time.time()
            rec.parent, self.current = self.current, rec

    def end(self, rec: OpRecord | None) -> None:
        """``rec`` is done; the main thread is back in what it was in before."""
        if rec is None or rec.state == "done":
            return
        with self.lock:
            rec.t_end = time.time()
            if rec.state == "waiting":
                if self.current is rec:
                    self.current = rec.parent
                if rec.op != "compute":  # time blocked on communication (slow-rank logging)
                    self.comm_wait_s += rec.t_end - rec.t_wait
            rec.state, rec.parent = "done", None

    # --- reading -----------------------------------------------------------------------------

    def records(self) -> list[OpRecord]:
        """The ring's records, oldest first."""
        with self.lock:
            n = min(self.count, self.capacity)
            return [self.ring[i % self.capacity] for i in range(self.count - n, self.count)]

    def snapshot(self) -> dict:
        """What this rank publishes when a hang is suspected (JSON-ready)."""
        with self.lock:
            current = self.current.index if self.current is not None else None
            counters = list(self._seq.items())
            stack, rec = [], self.current
            while rec is not None:
                stack.append(rec.index)
                rec = rec.parent
        return {
            "rank": self.rank,
            "coords": dict(self.coords),
            "now": time.time(),
            "current": current,
            "stack": stack,
            "records": [r.as_dict() for r in self.records()],
            "counters": [[list(ch), n] for ch, n in counters],
        }


def tensor_shape(t: torch.Tensor | list[torch.Tensor]) -> tuple[int, ...]:
    """The shape a record keeps: a tensor's, or the first of a list's."""
    return tuple(t[0].shape if isinstance(t, (list, tuple)) else t.shape)


class RecordedWork:
    """Works of one recorded asynchronous op (a collective made of several sends and receives):
    ``wait`` marks the main thread blocked on the record, waits on every work, then ends it."""

    def __init__(self, works: list, rec: OpRecord | None, recorder: OpRecorder):
        self.works, self.rec, self.recorder = works, rec, recorder

    def wait(self) -> None:
        self.recorder.wait(self.rec)
        for work in self.works:
            work.wait()
        self.recorder.end(self.rec)


RECORDER = OpRecorder()
