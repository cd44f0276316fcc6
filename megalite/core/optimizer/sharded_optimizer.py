"""The sharded optimizer: fp32 master parameters and Adam states sharded over the data-parallel
group, for every sharded rung of the ladder (ZeRO-1, 2 and 3), with optional offload.

    model = Zero1DataParallel(module, dp_group=ps.group("dp", "cp"), ...)   # or Zero2 / Zero3
    optimizer = build_sharded_optimizer(model, lr=..., weight_decay=..., mp_group=ps.mp_group)
    ... forward_backward; model.finish_grad_sync(); optimizer.step()

A ``MixedPrecisionOptimizer`` like the unsharded one (same ``step()``, state dicts and full state),
so the training loop does not branch. It reads the rung from the model: the grads are this rank's
shard of each bucket (in a whole grad buffer under ZeRO-1, a ``ShardedGradBuffer`` under ZeRO-2/3),
and the updated params go into the param buffer's shard, then ``model.gather_params()`` (ZeRO-1/2:
an all-gather over DP; ZeRO-3: the param shard itself, gathered per unit at its next use). Per-rank
optimizer state for ``P`` parameters (this model-parallel rank) and DP size ``d``: ``12P/d``
(master + exp_avg + exp_avg_sq) instead of ``12P``; ``offload`` moves a fraction of it to the host
or to files (``sharded_state``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from megalite.core.distributed.zero1_data_parallel import Zero1DataParallel
from megalite.core.distributed.zero3_data_parallel import Zero3DataParallel
from megalite.core.optimizer import sharded_state_format as ckpt
from megalite.core.optimizer.full_state_format import check_full_state
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.mixed_precision import MixedPrecisionOptimizer, StepGrads
from megalite.core.optimizer.sharded_state import (
    DiskPiece,
    OffloadSpec,
    ShardState,
    adam_on_disk,
    adam_on_host,
)
from megalite.core.optimizer.streamed_grads import StreamedGrads


@dataclass
class _Piece:
    """The part of one model parameter inside this rank's shard: elements ``[lo, hi)`` of
    ``param.view(-1)``, at ``buffer_lo`` in its buffer and ``shard_lo`` in the rank's flat shard."""

    param: nn.Parameter
    buffer: int  # index into ShardedOptimizer.buffers
    group: int  # index into param_groups
    lo: int
    hi: int
    buffer_lo: int
    shard_lo: int
    master: nn.Parameter  # fp32 [hi - lo]: a view of the master shard (or of the fp32 param);
    # on disk (NVMe offload): a 0-element placeholder, the state is streamed in step()
    counted: bool  # enters the grad norm (MixedPrecisionOptimizer.is_counted)
    zeros_counted: bool  # enters num_zeros_in_grad
    expert: bool = False  # an expert parameter (sharded over the expert DP group)
    where: str = "device"  # of its optimizer state: device | host | disk


class ShardedOptimizer(MixedPrecisionOptimizer):
    """Adam (or AdamW) over the shards of a sharded-rung model (``Zero1DataParallel`` or its
    subclasses ``Zero2DataParallel``, ``Zero3DataParallel``). Who owns what:

    - DP rank ``r`` owns, in every bucket of every buffer, the ``r``-th of ``dp_size`` equal
      contiguous shards (``GradBufferLayout.shard_range``); for that shard, and only for it, it
      holds the fp32 master params (unless the params are fp32: then the param shard is the
      master), ``exp_avg`` and ``exp_avg_sq``, each one flat fp32 tensor per buffer, the shards of
      all buckets concatenated; and only it updates those elements. A parameter cut by a shard
      boundary is updated in parts by two ranks (a ``_Piece`` each);
    - after the update the params are rebuilt from the shards (``model.gather_params``).

    The norm, the inf/NaN flag and the zero count are reduced over DP (each rank holds a shard)
    then over the model-parallel group; for expert parameters (their own buffers, sharded over
    ``model.expert_dp_group``) over the expert DP group then ``expert_mp_group``.
    ``build_inner(groups)`` must return ``torch.optim.Adam`` or ``AdamW``.
    """

    is_sharded = True  # each DP rank holds its shard: checkpoints write distrib_optim files

    def __init__(
        self,
        param_groups: list[dict],
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        model: Zero1DataParallel,
        clip_grad: float,
        mp_group,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
        expert_mp_group=None,
        expert_tp_rank: int = 0,
        offload: OffloadSpec | None = None,
    ):
        if not isinstance(model, Zero1DataParallel):
            raise TypeError(
                "ShardedOptimizer needs the model wrapped in a sharded rung (Zero1DataParallel, "
                "Zero2DataParallel or Zero3DataParallel)"
            )
        super().__init__(
            param_groups,
            model=model,
            clip_grad=clip_grad,
            tp_rank=tp_rank,
            duplicates=duplicates,
            loss_scaler=loss_scaler,
            count_zeros=count_zeros,
            expert_tp_rank=expert_tp_rank,
        )
        self.model, self.dp_group, self.dp_size = model, model.dp_group, model.dp_size
        self.mp_group = mp_group
        self.reduce_groups = (self.dp_group, mp_group)
        self.expert_reduce_groups = (model.expert_dp_group, expert_mp_group)
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        self.offload = offload
        self.buffers = [
            ShardState(
                d,
                g,
                dp_size=g.dp_size,
                dp_rank=g.dp_rank,
                param_shard=model.param_shard_of(g),
                offload=offload,
                params_offloaded=isinstance(model, Zero3DataParallel)
                and model.param_store.place != "device",
                name=f"opt{id(self):x}_b{b}",
            )
            for b, (d, g) in enumerate(model.buffer_pairs())
        ]
        self.pieces: list[_Piece] = []
        seen = set()
        for b, sb in enumerate(self.buffers):
            for param, (p_lo, p_hi, k) in sb.grad_buffer.param_ranges.items():
                if param not in group_of:
                    raise ValueError(f"parameter {self.name_of.get(param)} is in no param group")
                seen.add(param)
                s_lo, s_hi, shard_lo = sb.segments[k]
                lo, hi = max(p_lo, s_lo), min(p_hi, s_hi)
                cut = sb.cut + s_lo - shard_lo  # the offload cut in buffer coordinates
                for x, y in ((lo, min(hi, cut)), (max(lo, cut), hi)):  # split at the cut
                    if x >= y:
                        continue
                    s = shard_lo + x - s_lo
                    master = sb.master_at(s, y - x)
                    if master is None:  # on disk: streamed
                        master = torch.empty(0, dtype=torch.float32, device=sb.device)
                    self.pieces.append(
                        _Piece(
                            param=param,
                            buffer=b,
                            group=group_of[param],
                            lo=x - p_lo,
                            hi=y - p_lo,
                            buffer_lo=x,
                            shard_lo=s,
                            master=nn.Parameter(master),
                            counted=self.is_counted(param),
                            zeros_counted=self.zeros_counted(param),
                            expert=sb.grad_buffer.expert,
                            where=sb.where(s),
                        )
                    )
        if len(seen) != len(group_of):
            raise ValueError(
                f"{len(group_of) - len(seen)} optimized parameters have no grad buffer"
            )
        self.optimizer = build_inner(
            [
                {**g, "params": [pc.master for pc in self.in_memory if pc.group == i]}
                for i, g in enumerate(param_groups)
            ]
        )
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(
                f"the sharded optimizer shards Adam states; got {type(self.optimizer).__name__}"
            )
        on_disk = {pc.group for pc in self.pieces if pc.where == "disk"}
        if any(self.optimizer.param_groups[i]["amsgrad"] for i in on_disk):
            raise ValueError("optimizer state in files (NVMe offload) keeps no amsgrad maximum")
        for pc in self.in_memory:  # the Adam states are views of the flat per-buffer shards
            sb, s, n = self.buffers[pc.buffer], pc.shard_lo, pc.hi - pc.lo
            self.optimizer.state[pc.master] = {
                "step": torch.zeros((), dtype=torch.float32, device=self._step_device(pc)),
                "exp_avg": sb.state_at("exp_avg", s, n),
                "exp_avg_sq": sb.state_at("exp_avg_sq", s, n),
            }
        self.steps = 0
        self._host_grads: dict[int, torch.Tensor] = {}  # id(piece) -> its grad, during step()
        self._agree_on_experts()
        self.streamed: StreamedGrads | None = None  # the grad shards in files: read in chunks
        if isinstance(model, Zero3DataParallel) and model.grad_files is not None:
            self.streamed = StreamedGrads(
                model.grad_files,
                self.buffers,
                self.pieces,
                loss_scaler=loss_scaler,
                count_zeros=count_zeros,
            )

    @property
    def in_memory(self) -> list[_Piece]:
        """The pieces whose state the inner optimizer steps (device or host; not disk)."""
        return [pc for pc in self.pieces if pc.where != "disk"]

    def _step_device(self, pc: _Piece) -> torch.device:
        g = self.optimizer.param_groups[pc.group]
        on_device = g.get("fused") or g.get("capturable")
        return pc.master.device if on_device else torch.device("cpu")

    @property
    def master_params(self) -> list[nn.Parameter]:
        """This rank's fp32 pieces (views of the master shards) the inner optimizer steps."""
        return [pc.master for pc in self.in_memory]

    def zero_grad(self) -> None:
        """Drop the master grads and the fp32 grad copy (the grad buffer is zeroed by the model)."""
        super().zero_grad()
        for sb in self.buffers:
            sb.grad_flat = None

    # --- the step (MixedPrecisionOptimizer.step) --------------------------------------------------

    def _prepare_grads(self) -> StepGrads:
        self.model.finish_param_sync()  # no param all-gather may still write the buffers
        if self.streamed is not None:  # read from the files by _grad_norm and _step_on_disk
            self._piece_grads = [None] * len(self.pieces)
            return StepGrads([], [], [])
        segments = [g for sb in self.buffers for g in sb.fp32_grad_segments()]
        grads = [self.buffers[pc.buffer].grad_at(pc.shard_lo, pc.hi - pc.lo) for pc in self.pieces]
        self._piece_grads = grads
        for pc, g in zip(self.pieces, grads):
            if pc.where == "device":
                pc.master.grad = g
        counted = [g for pc, g in zip(self.pieces, grads) if pc.counted and not pc.expert]
        zeros = [g for pc, g in zip(self.pieces, grads) if pc.zeros_counted and not pc.expert]
        counted_expert = [g for pc, g in zip(self.pieces, grads) if pc.counted and pc.expert]
        zeros_expert = [g for pc, g in zip(self.pieces, grads) if pc.zeros_counted and pc.expert]
        return StepGrads(segments, counted, zeros, counted_expert, zeros_expert)

    def _grad_norm(self, grads: StepGrads) -> torch.Tensor:
        if self.streamed is None:
            return super()._grad_norm(grads)
        return self.streamed.norm(self.pieces, groups=self.reduce_groups, device=self._device)

    def _clip(self, grads: StepGrads, norm: torch.Tensor) -> None:
        if self.streamed is None:
            super()._clip(grads, norm)
        else:
            self.streamed.clip(norm, self.clip_grad)

    def _before_inner_step(self) -> None:
        """Offloaded to the host: the unscaled, clipped grads copied next to their masters (the
        inner optimizer skips these pieces: no ``.grad``; ``_step_on_host`` steps them)."""
        self._host_grads = {
            id(pc): g.to(pc.master.device, non_blocking=True)
            for pc, g in zip(self.pieces, self._piece_grads)
            if pc.where == "host"
        }
        if self._device.type == "cuda" and self._host_grads:
            torch.cuda.current_stream(self._device).synchronize()  # the host step reads them next

    def _update_model_params(self) -> None:
        self.steps += 1
        self._step_on_host()
        self._step_on_disk()
        self.update_model_params(include_disk=False)

    @torch.no_grad()
    def _step_on_host(self) -> None:
        """The host pieces, one ``adam_on_host`` call per param group."""
        for i, group in enumerate(self.optimizer.param_groups):
            pieces = [pc for pc in self.pieces if pc.where == "host" and pc.group == i]
            if not pieces:
                continue
            adam_on_host(
                [pc.master for pc in pieces],
                [self._host_grads[id(pc)] for pc in pieces],
                [self.optimizer.state[pc.master] for pc in pieces],
                group,
            )
        self._host_grads = {}

    def _step_on_disk(self) -> None:
        """NVMe offload: Adam over the state in files, per buffer (``adam_on_disk``: bounded
        chunks that span pieces, read, updated, written back, rounded into the params)."""
        for b, sb in enumerate(self.buffers):
            pieces = [
                DiskPiece(pc.shard_lo, pc.hi - pc.lo, pc.group, g)
                for pc, g in zip(self.pieces, self._piece_grads)
                if pc.buffer == b and pc.where == "disk"
            ]
            if not pieces:
                continue
            read = None if self.streamed is None else partial(self.streamed.read, b)
            adam_on_disk(sb, pieces, self.optimizer.param_groups, step=self.steps, read_grads=read)

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    def remove_offload_files(self) -> None:
        """The end of a run: delete the state files this optimizer created (NVMe offload)."""
        for sb in self.buffers:
            if sb.store is not None:
                sb.store.remove_files()

    def update_model_params(self, *, include_disk: bool = True) -> None:
        """Masters -> this rank's shard of the param buffer (rounded), then all-gather over DP."""
        for sb in self.buffers:
            sb.masters_to_params(include_disk=include_disk)
        self.model.gather_params()

    def set_step(self, step: int) -> None:
        """The Adam step count of every piece (after loading a state)."""
        self.steps = step
        for pc in self.in_memory:
            self.optimizer.state[pc.master]["step"].fill_(float(step))

    # --- checkpoints (the sharded format: megalite.core.optimizer.sharded_state_format) ----------

    def state_dict(self) -> dict:
        """What ``distrib_optim.pt`` holds: ``sharded_state_dict()``."""
        return self.sharded_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_sharded_state_dict(state)

    def _layouts(self) -> list[dict]:
        out = []
        for sb in self.buffers:
            params = sb.grad_buffer.params
            out.append(
                ckpt.layout_entry(
                    sb.grad_buffer.layout,
                    param_dtype=sb.param_dtype,
                    names=[self.name_of[p] for p in params],
                    shapes=[p.shape for p in params],
                    expert=sb.grad_buffer.expert,
                )
            )
        return out

    def sharded_state_dict(self) -> dict:
        """This DP rank's range only (copies; no communication)."""
        self.model.finish_param_sync()
        buffers = [
            {**layout, **{key: sb.read_shard(key) for key in ckpt.STATE_KEYS}}
            for layout, sb in zip(self._layouts(), self.buffers)
        ]
        return {
            "format": ckpt.FORMAT,
            "dp_size": self.dp_size,
            "dp_rank": self.model.dp_rank,
            "buffers": buffers,
            "step": self.steps,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    @torch.no_grad()
    def load_sharded_state_dict(self, sd: dict) -> None:
        """Inverse of ``sharded_state_dict`` on the same DP size and buckets; the model params are
        then rebuilt from the masters (an all-gather: every DP rank calls it)."""
        self.model.finish_param_sync()
        ckpt.check_loadable(
            sd, dp_size=self.dp_size, dp_rank=self.model.dp_rank, layouts=self._layouts()
        )
        for sb, saved in zip(self.buffers, sd["buffers"]):
            for key in ckpt.STATE_KEYS:
                sb.write_shard(key, saved[key])
        for group, saved_group in zip(self.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._load_step_and_scaler(sd["step"], sd.get("scaler"))
        self.update_model_params()

    def full_state_dict(self, *, copy: bool = True) -> dict:
        """Layout-independent state (``megalite.core.optimizer.full_state_format``), gathered over
        DP: a collective, every DP rank calls it and gets the same dict (always copies)."""
        del copy  # gathered tensors are new anyway
        self.model.finish_param_sync()
        params = {}
        for sb in self.buffers:
            fulls = {}
            for key in ckpt.STATE_KEYS:
                if key == "master" and sb.master is None and sb.param_shard is None and not sb.cut:
                    # fp32 params, whole param buffer: it is current
                    fulls[key] = sb.param_data.detach().clone()
                else:
                    fulls[key] = ckpt.gather_full(sb.grad_buffer, sb.read_shard(key))
            for param, (lo, hi, _) in sb.grad_buffer.param_ranges.items():
                params[self.name_of[param]] = {
                    k: v[lo:hi].view(param.shape).clone() for k, v in fulls.items()
                }
        scaler = None if self.loss_scaler is None else self.loss_scaler.state_dict()
        return {"params": params, "step": self.steps, "scaler": scaler}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """Inverse of ``full_state_dict`` (from either optimizer, any DP size): each DP rank keeps
        its range; the model params are set from the full masters (no communication)."""
        self.model.finish_param_sync()
        check_full_state(sd, {self.name_of[p]: p.shape for p in self.model_params})
        params = sd["params"]
        for b, sb in enumerate(self.buffers):
            for key in ckpt.STATE_KEYS:
                shard = torch.zeros(sb.numel, dtype=torch.float32, device=sb.device)
                for pc in self.pieces:
                    if pc.buffer == b:
                        entry = params[self.name_of[pc.param]][key].reshape(-1)
                        shard[pc.shard_lo : pc.shard_lo + pc.hi - pc.lo].copy_(entry[pc.lo : pc.hi])
                sb.write_shard(key, shard)
        with self.model.gathered_params():  # every rank has the full masters: no gather needed
            for p in self.model_params:
                p.copy_(params[self.name_of[p]]["master"])
        self._load_step_and_scaler(sd["step"], sd.get("scaler"))

    def _load_step_and_scaler(self, step, scaler: dict | None) -> None:
        self.set_step(int(step))
        if self.loss_scaler is not None and scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
