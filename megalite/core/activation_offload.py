"""Activation offload: the tensors autograd saves for backward inside a region, kept in host
memory between forward and backward (Megatron's ``--cpu-offloading``; with full recompute the
region is a checkpoint call, whose saved inputs are what moves: DeepSpeed's
``cpu_checkpointing``).

    offload = ActivationOffload()
    with offload.region(key=layer_number, params=layer.parameters()):
        hidden = layer(hidden)             # its saved activations go to the host
    ... backward brings them back, region by region

Packing (``torch.autograd.graph.saved_tensors_hooks``) copies each saved tensor into host storage
of its own and lets autograd forget the original, so the device copy is freed as soon as nothing
else holds it. Unpacking (in backward) returns a device tensor with the same values:

- on CUDA the host copies are pinned; the device-to-host copies run on a side stream (the compute
  stream's work up to the save is waited for, and the original is kept alive for the side stream
  with ``record_stream``); in backward the first unpack of a region copies the whole region back
  on the side stream and starts the copy of the region saved just before it (the next one
  backward needs), so the transfer of region ``i - 1`` overlaps the backward of region ``i``;
- on CPU the copy is a real one (separate storage, which is what the placement test observes) and
  backward reads the host copy itself.

Parameters, and views of them (a transposed weight a matmul saves), are never moved: they are
model state and stay where they are; a tensor is skipped when it shares storage with a parameter
given to ``region``. One tensor saved by several ops of a region (the same storage, offset, shape,
strides and version) is copied once. Copies are exact, so a run with offload computes bit for bit
what the run without it does.

``moved_bytes[key]`` / ``moved_tensors[key]`` count, per region key, what was copied to the host
(the bytes of the copies, from the tensors), over the life of the object.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class _Region:
    """One forward pass through a region: its host copies and, on CUDA, their transfers."""

    def __init__(self, device: torch.device, previous: _Region | None):
        self.device = device
        # the region saved just before this one in the same forward (backward needs it next);
        # weak: a region lives only while autograd holds its packed tensors
        self.previous = None if previous is None else weakref.ref(previous)
        self.host: list[torch.Tensor] = []  # the copies, in pack order
        self.on_device: list[torch.Tensor] | None = None  # CUDA: brought back in backward
        self.saved: dict[tuple, int] = {}  # dedup: the same tensor saved twice is copied once
        self.keep: list[torch.Tensor] = []  # originals behind ``saved`` while the region runs
        self.stored: torch.cuda.Event | None = None  # CUDA: the device-to-host copies are done
        self.loaded: torch.cuda.Event | None = None  # CUDA: the host-to-device copies are done


class ActivationOffload:
    """Saved-tensor hooks that keep a region's activations on the host. One object per model chunk
    (its regions are the chunk's offloaded layers); ``region`` may be entered any number of times
    (micro-batches, pipeline schedules: each entry is its own set of copies)."""

    def __init__(self) -> None:
        self.moved_bytes: dict[int, int] = {}
        self.moved_tensors: dict[int, int] = {}
        self._stream: torch.cuda.Stream | None = None  # created at the first CUDA save
        self._last = None  # weakref to the region packed last in this forward (see new_forward)

    def new_forward(self) -> None:
        """A forward of the chunk starts: its first region has no predecessor to prefetch (the
        regions of another micro-batch are needed at another time)."""
        self._last = None

    @contextmanager
    def region(self, *, key: int, params: Iterable[torch.Tensor]) -> Iterator[None]:
        """Offload what autograd saves inside this block (``key`` names it in the counters;
        ``params``: the parameters whose storage is never moved)."""
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.moved_bytes.setdefault(key, 0)
        self.moved_tensors.setdefault(key, 0)
        state: dict[str, _Region] = {}

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter) or (
                t.untyped_storage().data_ptr() in param_storages
            ):
                return t  # model state: stays where it is
            if "region" not in state:
                previous = None if self._last is None else self._last()
                if previous is not None and previous.device != t.device:
                    previous = None
                state["region"] = _Region(t.device, previous)
                self._last = weakref.ref(state["region"])
            reg = state["region"]
            ident = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t._version,
            )
            index = reg.saved.get(ident)
            if index is None:
                index = reg.saved[ident] = len(reg.host)
                reg.host.append(self._to_host(t))
                reg.keep.append(t)
                self.moved_bytes[key] += t.numel() * t.element_size()
                self.moved_tensors[key] += 1
            return (reg, index)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            reg, index = packed
            if reg.device.type != "cuda":
                return reg.host[index]
            self._load(reg)
            previous = None if reg.previous is None else reg.previous()
            if previous is not None:
                self._load(previous)  # prefetch: backward needs it next
            torch.cuda.current_stream(reg.device).wait_event(reg.loaded)
            return reg.on_device[index]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        reg = state.get("region")
        if reg is not None:
            reg.keep, reg.saved = [], {}  # the originals may go (CUDA: record_stream holds them)
            if reg.device.type == "cuda":
                reg.stored = torch.cuda.Event()
                reg.stored.record(self._side_stream(reg.device))

    # --- the transfers ----------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` in storage of its own (CUDA: pinned, copied on the side stream)."""
        if t.device.type != "cuda":
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
            return host
        side = self._side_stream(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is written by then
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        t.record_stream(side)  # its memory is not reused before the copy has read it
        return host

    def _load(self, reg: _Region) -> None:
        """Start copying ``reg`` back to its device on the side stream (once)."""
        if reg.on_device is not None:
            return
        side = self._side_stream(reg.device)
        current = torch.cuda.current_stream(reg.device)
        side.wait_stream(current)  # the buffers it allocates are free for the side stream
        if reg.stored is not None:
            side.wait_event(reg.stored)
        with torch.cuda.stream(side):
            reg.on_device = [h.to(reg.device, non_blocking=True) for h in reg.host]
        for t in reg.on_device:
            t.record_stream(current)  # used (and freed) on the compute stream
        reg.loaded = torch.cuda.Event()
        reg.loaded.record(side)
        reg.host = []  # pinned blocks are reused only after the copies that read them are done
