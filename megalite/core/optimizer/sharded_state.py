"""One DP rank's shard of the optimizer state of one grad buffer, on the device, the host or disk.

The shard is this rank's part of every bucket, concatenated (``segments``: one ``(buffer_lo,
buffer_hi, shard_lo)`` per bucket). Its fp32 state (master params, ``exp_avg``, ``exp_avg_sq``)
is cut at ``cut`` (``offload.fraction`` of the shard, the run's ``optimizer_offload_fraction``):

    [0, cut)        offloaded: on the host (pinned when the params are on CUDA), or with
                    ``offload.directory`` in files (``NvmeStore``), streamed in sub-groups
    [cut, numel)    on the device; fp32 params are their own masters there (the param buffer's
                    shard, or ZeRO-3's param shard, is updated in place)

ZeRO-3 with its param shard offloaded (``params_offloaded``: on the host, or a ``ParamFile``):
fp32 params on the host are their own offloaded masters (one copy), and fp32 params in a file are
the master file of the NVMe state; a param file needs the whole state offloaded (``cut == numel``).

Without offload ``cut`` is 0: the whole shard on the device. ``param_at`` / ``master_at`` /
``state_at`` take shard coordinates; a piece (part of one parameter in one bucket) never crosses
a segment or ``cut`` (the optimizer splits them there).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim.adam import adam

from megalite.core.distributed.grad_buffer import GradBuffer
from megalite.core.distributed.param_offload import ParamFile
from megalite.core.optimizer.full_state_format import ADAM_KEYS
from megalite.core.optimizer.nvme_store import NvmeStore, chunk_spans

STATE_KEYS = ("master", *ADAM_KEYS)


@dataclass(frozen=True)
class OffloadSpec:
    """``fraction`` of each shard's optimizer state (and its step) off the device: on the host,
    or in files under ``directory`` streamed through ``host_bytes`` of host buffers."""

    fraction: float = 1.0
    directory: str | None = None
    host_bytes: int = 256 << 20

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"offload fraction must be in [0, 1], got {self.fraction}")


class ShardState:
    def __init__(
        self,
        param_data: torch.Tensor | None,
        grad_buffer: GradBuffer,
        *,
        dp_size: int,
        dp_rank: int,
        param_shard: torch.Tensor | ParamFile | None = None,
        offload: OffloadSpec | None = None,
        name: str = "b0",
        params_offloaded: bool = False,
    ):
        self.param_data, self.grad_buffer = param_data, grad_buffer
        self.param_shard = param_shard  # ZeRO-3: the flat param shard (param_data is None)
        self.param_file = param_shard if isinstance(param_shard, ParamFile) else None
        self.segments = grad_buffer.layout.shard_segments(dp_size, dp_rank)
        self._shard_starts = [s for _, _, s in self.segments]
        self.numel = sum(hi - lo for lo, hi, _ in self.segments)
        ref = param_data if param_shard is None else param_shard
        self.param_dtype, self.device = ref.dtype, ref.device
        self.cut = 0 if offload is None else round(offload.fraction * self.numel)
        if self.param_file is not None and self.cut != self.numel:
            raise ValueError(
                f"parameters offloaded to files need the whole optimizer state offloaded "
                f"(offload fraction 1): {self.cut} of {self.numel} elements are"
            )
        # the param shard is offloaded (host or file) and fp32: it is the offloaded master
        f32_params_off = params_offloaded and self.param_dtype == torch.float32
        self.store: NvmeStore | None = None
        self.host: dict[str, torch.Tensor] = {}
        n_dev, f32 = self.numel - self.cut, torch.float32
        self.master = None  # device masters of [cut, numel) (16-bit params only)
        if self.param_dtype != f32:
            self.master = torch.empty(n_dev, dtype=f32, device=self.device)
            self.master.copy_(self._param_range(self.cut, self.numel))
        self.exp_avg = torch.zeros(n_dev, dtype=f32, device=self.device)
        self.exp_avg_sq = torch.zeros(n_dev, dtype=f32, device=self.device)
        if self.cut and offload.directory is not None:
            prefix = f"rank{_global_rank()}_{name}_{os.getpid()}"
            adopt = f32_params_off and self.param_file is not None
            self.store = NvmeStore(
                offload.directory,
                prefix,
                self.cut,
                host_bytes=int(offload.host_bytes),
                device=self.device,
                existing={"master": self.param_file.path} if adopt else None,
            )
            for a, b in self.store.chunks(0, 0 if adopt else self.cut):  # the masters, streamed in
                self.store.stage("master", self._param_range(a, b))
                self.store.save(a, b, keys=("master",))
        elif self.cut:
            pin = self.device.type == "cuda"
            for key in STATE_KEYS:
                if key == "master" and f32_params_off:
                    self.host[key] = param_shard[: self.cut]  # the params are the masters
                    continue
                self.host[key] = torch.zeros(self.cut, dtype=f32, pin_memory=pin)
            if not f32_params_off:
                self.host["master"].copy_(self._param_range(0, self.cut))
        self.masters_are_params = f32_params_off
        self.grad_flat: torch.Tensor | None = None  # fp32 copy of 16-bit grads during step()

    # --- where things are (shard coordinates) -----------------------------------------------------

    def _segment(self, shard_lo: int) -> tuple[int, int, int]:
        return self.segments[bisect.bisect_right(self._shard_starts, shard_lo) - 1]

    def param_at(self, shard_lo: int, n: int) -> torch.Tensor:
        """The model params (param dtype) of shard elements ``[shard_lo, shard_lo + n)`` (not for
        a param file: ``_param_range`` / ``copy_to_params`` stream it)."""
        if self.param_file is not None:
            raise ValueError("the param shard is in a file: read or write it through ParamFile")
        if self.param_shard is not None:
            return self.param_shard[shard_lo : shard_lo + n]
        lo, _, s = self._segment(shard_lo)
        return self.param_data[lo + shard_lo - s : lo + shard_lo - s + n]

    def _param_range(self, a: int, b: int) -> torch.Tensor:
        """Params of shard ``[a, b)`` as fp32, across segments (a copy)."""
        if self.param_file is not None:  # the flat shard is contiguous in shard coordinates
            return self.param_file.read(a, b).float()
        parts = []
        for lo, hi, s in self.segments:
            x, y = max(a, s), min(b, s + hi - lo)
            if x < y:
                parts.append(self.param_at(x, y - x).float())
        return torch.cat(parts) if parts else torch.empty(0, device=self.device)

    def where(self, shard_lo: int) -> str:
        if shard_lo >= self.cut:
            return "device"
        return "disk" if self.store is not None else "host"

    def master_at(self, shard_lo: int, n: int) -> torch.Tensor | None:
        """The fp32 masters of ``[shard_lo, shard_lo + n)`` (None on disk)."""
        where = self.where(shard_lo)
        if where == "host":
            return self.host["master"][shard_lo : shard_lo + n]
        if where == "disk":
            return None
        if self.master is None:
            return self.param_at(shard_lo, n)
        return self.master[shard_lo - self.cut : shard_lo - self.cut + n]

    def state_at(self, key: str, shard_lo: int, n: int) -> torch.Tensor | None:
        where = self.where(shard_lo)
        if where == "host":
            return self.host[key][shard_lo : shard_lo + n]
        if where == "disk":
            return None
        return getattr(self, key)[shard_lo - self.cut : shard_lo - self.cut + n]

    # --- grads ------------------------------------------------------------------------------------

    def fp32_grad_segments(self) -> list[torch.Tensor]:
        """The DP-reduced grads of this shard in fp32 (views of the grad buffer when it is fp32)."""
        views = [self.grad_buffer.view(lo, hi) for lo, hi, _ in self.segments]
        if self.grad_buffer.grad_dtype == torch.float32:
            return views
        self.grad_flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        out = [self.grad_flat[s : s + hi - lo] for lo, hi, s in self.segments]
        for g, v in zip(out, views):
            g.copy_(v)
        return out

    def grad_at(self, shard_lo: int, n: int) -> torch.Tensor:
        if self.grad_flat is not None:
            return self.grad_flat[shard_lo : shard_lo + n]
        lo, _, s = self._segment(shard_lo)
        return self.grad_buffer.view(lo + shard_lo - s, lo + shard_lo - s + n)

    # --- whole-shard access (checkpoints) ---------------------------------------------------------

    def read_shard(self, key: str) -> torch.Tensor:
        """The flat fp32 shard [numel] of ``key`` (a copy, on the device)."""
        if self.store is not None:
            off = self.store.read(key).to(self.device)
        elif self.cut:
            off = self.host[key].to(self.device)
        else:
            off = torch.empty(0, device=self.device)
        if key == "master" and self.master is None:
            dev = self._param_range(self.cut, self.numel)
        else:
            dev = (self.master if key == "master" else getattr(self, key)).float().clone()
        return torch.cat([off, dev])

    @torch.no_grad()
    def write_shard(self, key: str, values: torch.Tensor) -> None:
        """Inverse of ``read_shard`` (the model params are not touched: ``masters_to_params``)."""
        values = values.to(self.device, torch.float32)
        if self.store is not None:
            self.store.write(key, values[: self.cut])
        elif self.cut:
            self.host[key].copy_(values[: self.cut])
        rest = values[self.cut :]
        if key == "master" and self.master is None:
            for lo, hi, s in self.segments:
                x, y = max(self.cut, s), s + hi - lo
                if x < y:
                    self.param_at(x, y - x).copy_(rest[x - self.cut : y - self.cut])
        else:
            (self.master if key == "master" else getattr(self, key)).copy_(rest)

    @torch.no_grad()
    def masters_to_params(self, *, include_disk: bool = True) -> None:
        """Round every master into the model params of this shard (disk: streamed)."""
        if self.master is not None:
            self.copy_to_params(self.cut, self.master)
        if self.store is not None and include_disk:
            for a, b in self.store.chunks(0, self.cut):
                master, _ = self.store.load(a, b, keys=("master",))
                self.copy_to_params(a, master)
        elif self.cut and self.store is None:
            self.copy_to_params(0, self.host["master"])

    def copy_to_params(self, start: int, values: torch.Tensor) -> None:
        """``values`` (fp32, shard elements from ``start``) into the params, per segment."""
        if self.masters_are_params and start < self.cut:
            return  # the offloaded masters are the params themselves (written in place)
        if self.param_file is not None:
            self.param_file.write(start, values)
            return
        end = start + values.numel()
        for lo, hi, s in self.segments:
            x, y = max(start, s), min(end, s + hi - lo)
            if x < y:
                self.param_at(x, y - x).copy_(values[x - start : y - start], non_blocking=True)

    def bytes_by_place(self) -> dict[str, int]:
        """Optimizer-state bytes on the device (masters that are not the params, moments), the
        host (offloaded state, or the NVMe stream buffers) and disk."""
        dev = (self.exp_avg.numel() + self.exp_avg_sq.numel()) * 4
        dev += 0 if self.master is None else self.master.numel() * 4
        host = sum(t.numel() * 4 for t in self.host.values())
        disk = 0
        if self.store is not None:
            host, disk = self.store.host_bytes, self.store.disk_bytes
        return {"device": dev, "host": host, "disk": disk}


@torch.no_grad()
def adam_on_host(
    masters: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], group: dict
) -> None:
    """One update of host-resident fp32 masters by torch's fused CPU Adam kernel: one vectorised,
    threaded pass over the state, several times torch's default single-tensor loop on CPU
    (``tools/bench/bench_cpu_adam.py``); the result is within a few ulp of it (the offload tests
    hold it to the unsharded step at 1e-6). ``group``: the inner torch optimizer's param group
    (AdamW or Adam, amsgrad, maximize as set there); ``states``: its per-master state, whose
    ``step`` tensors the kernel advances."""
    amsgrad = group["amsgrad"]
    adam(
        masters,
        grads,
        [st["exp_avg"] for st in states],
        [st["exp_avg_sq"] for st in states],
        [st.setdefault("max_exp_avg_sq", torch.zeros_like(st["exp_avg_sq"])) for st in states]
        if amsgrad
        else [],
        [st["step"] for st in states],
        fused=True,
        decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=amsgrad,
        beta1=group["betas"][0],
        beta2=group["betas"][1],
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


class DiskPiece(NamedTuple):
    """A parameter's piece of a shard whose state is in files: shard elements ``[start, start +
    numel)``, the index of its param group, its grads (``numel``; None: read from grad files)."""

    start: int
    numel: int
    group: int
    grad: torch.Tensor | None


@torch.no_grad()
def adam_on_disk(
    sb: ShardState,
    pieces: list[DiskPiece],
    groups: list[dict],
    *,
    step: int,
    read_grads: Callable[[int, int], torch.Tensor] | None = None,
) -> None:
    """One update of the state in ``sb``'s files (``sb.store``), a chunk of at most
    ``sb.store.chunk`` shard elements at a time: one read of each state file, ``adam_on_host``
    over the pieces in the chunk (one call per param group: the same kernel as the host rung),
    one write back, the masters rounded into the params. A chunk spans many pieces, so each file
    is opened once per chunk, not once per piece. ``step``: the step being taken (1 first);
    ``read_grads(lo, hi)``: shard elements ``[lo, hi)`` of the grads, for pieces without
    ``grad``. Pinned buffers (CUDA): the grads are staged into the store's grad buffer."""
    store = sb.store
    for lo, hi, inside in chunk_spans(pieces, store.chunk):
        read = read_grads(lo, hi) if any(pc.grad is None for pc in inside) else None
        parts = []  # (offset from lo, grads) of each piece's part in [lo, hi)
        for pc in inside:
            x, y = max(lo, pc.start), min(hi, pc.start + pc.numel)
            g = read[x - lo : y - lo] if pc.grad is None else pc.grad[x - pc.start : y - pc.start]
            parts.append((x - lo, g))
        master, exp_avg, exp_avg_sq, staged = store.load(
            lo, hi, grads=parts if store.pinned else ()
        )  # the grads' copies to the host are in flight while the moments are read
        for i, group in enumerate(groups):
            mine = [(a, g) for pc, (a, g) in zip(inside, parts) if pc.group == i]
            if not mine:
                continue
            adam_on_host(
                [master[a : a + g.numel()] for a, g in mine],
                [staged[a : a + g.numel()] if store.pinned else g for a, g in mine],
                [
                    {
                        "exp_avg": exp_avg[a : a + g.numel()],
                        "exp_avg_sq": exp_avg_sq[a : a + g.numel()],
                        "step": torch.tensor(float(step - 1)),  # the kernel advances it
                    }
                    for a, g in mine
                ],
                group,
            )
        store.save(lo, hi)
        sb.copy_to_params(lo, master)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
