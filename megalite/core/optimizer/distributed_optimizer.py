"""ZeRO-1: fp32 master parameters and Adam states sharded over the data-parallel group.

    model = ZeroDataParallel(module, dp_group=ps.group("dp", "cp"), ...)
    optimizer = build_distributed_optimizer(model, lr=..., weight_decay=..., mp_group=ps.mp_group)
    ... forward_backward; model.finish_grad_sync(); optimizer.step()

A ``MixedPrecisionOptimizer`` like the plain one (same ``step()``, state dicts and full state), so
the training loop does not branch. Per-rank memory for ``P`` parameters (this model-parallel
rank) and DP size ``d``: the model's params (2P bytes in bf16) and grad buffer (4P in fp32) as
without ZeRO, plus ``12P/d`` of optimizer state (master + exp_avg + exp_avg_sq) instead of ``12P``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megalite.core.distributed.grad_buffer import GradBuffer
from megalite.core.distributed.zero_data_parallel import ZeroDataParallel
from megalite.core.optimizer import zero1_checkpoint as ckpt
from megalite.core.optimizer.full_state_format import ADAM_KEYS, check_full_state
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.mixed_precision import MixedPrecisionOptimizer, StepGrads


@dataclass
class _Piece:
    """The part of one model parameter inside this rank's shard: elements ``[lo, hi)`` of
    ``param.view(-1)``, at ``buffer_lo`` in its buffer and ``shard_lo`` in the rank's flat shard."""

    param: nn.Parameter
    buffer: int  # index into DistributedOptimizer.buffers
    group: int  # index into param_groups
    lo: int
    hi: int
    buffer_lo: int
    shard_lo: int
    master: nn.Parameter  # fp32 [hi - lo]: a view of the master shard (or of the fp32 param)
    counted: bool  # enters the grad norm (MixedPrecisionOptimizer.is_counted)
    zeros_counted: bool  # enters num_zeros_in_grad
    expert: bool = False  # an expert parameter (sharded over the expert DP group)


class _ShardedBuffer:
    """This DP rank's shard of one param dtype's buffers: ``segments`` = one
    ``(buffer_lo, buffer_hi, shard_lo)`` per bucket; the shard is their concatenation."""

    def __init__(
        self, param_data: torch.Tensor, grad_buffer: GradBuffer, *, dp_size: int, dp_rank: int
    ):
        self.param_data, self.grad_buffer = param_data, grad_buffer
        self.segments = grad_buffer.layout.shard_segments(dp_size, dp_rank)
        self.numel = sum(hi - lo for lo, hi, _ in self.segments)
        device = param_data.device
        # fp32 params are their own masters: the shard of the param buffer is updated in place
        self.master = None
        if param_data.dtype != torch.float32:
            self.master = torch.empty(self.numel, dtype=torch.float32, device=device)
            for (lo, hi, _), m in zip(self.segments, self.master_segments()):
                m.copy_(param_data[lo:hi])
        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.grad_flat: torch.Tensor | None = None  # fp32 copy of 16-bit grads during step()

    def master_segments(self) -> list[torch.Tensor]:
        if self.master is None:
            return [self.param_data[lo:hi] for lo, hi, _ in self.segments]
        return [self.master[s : s + hi - lo] for lo, hi, s in self.segments]

    def master_view(self, buffer_lo: int, shard_lo: int, n: int) -> torch.Tensor:
        if self.master is None:
            return self.param_data[buffer_lo : buffer_lo + n]
        return self.master[shard_lo : shard_lo + n]

    def master_shard(self) -> torch.Tensor:
        """The flat fp32 master shard [N/d] (a copy when the params are their own masters)."""
        if self.master is not None:
            return self.master
        segments = self.master_segments()
        return torch.cat(segments) if segments else self.exp_avg.new_empty(0)

    def shard_of(self, key: str) -> torch.Tensor:
        return self.master_shard() if key == "master" else getattr(self, key)

    def fp32_grad_segments(self) -> list[torch.Tensor]:
        """The DP-reduced grads of this shard in fp32 (views of the grad buffer when it is fp32)."""
        views = [self.grad_buffer.view(lo, hi) for lo, hi, _ in self.segments]
        if self.grad_buffer.grad_dtype == torch.float32:
            return views
        self.grad_flat = torch.empty(self.numel, dtype=torch.float32, device=self.exp_avg.device)
        out = [self.grad_flat[s : s + hi - lo] for lo, hi, s in self.segments]
        for g, v in zip(out, views):
            g.copy_(v)
        return out

    def grad_view(self, buffer_lo: int, shard_lo: int, n: int) -> torch.Tensor:
        if self.grad_flat is None:
            return self.grad_buffer.view(buffer_lo, buffer_lo + n)
        return self.grad_flat[shard_lo : shard_lo + n]


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1 Adam over the shards of a ``ZeroDataParallel`` model. Who owns what:

    - every DP rank holds the whole model (params in the param dtype) and a whole grad buffer;
    - DP rank ``r`` owns, in every bucket of every buffer, the ``r``-th of ``dp_size`` equal
      contiguous shards (``GradBufferLayout.shard_range``); for that shard, and only for it, it
      holds the fp32 master params (unless the params are fp32: then the param buffer's shard is
      the master), ``exp_avg`` and ``exp_avg_sq``, each one flat fp32 tensor per buffer, the
      shards of all buckets concatenated; and only it updates those elements. A parameter cut by
      a shard boundary is updated in parts by two ranks (a ``_Piece`` each);
    - after the update each rank's shard of the param buffer is all-gathered over DP.

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
        model: ZeroDataParallel,
        clip_grad: float,
        mp_group,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
        expert_mp_group=None,
        expert_tp_rank: int = 0,
    ):
        if not isinstance(model, ZeroDataParallel):
            raise TypeError("DistributedOptimizer needs the model wrapped in ZeroDataParallel")
        super().__init__(
            param_groups, model=model, clip_grad=clip_grad, tp_rank=tp_rank,
            duplicates=duplicates, loss_scaler=loss_scaler, count_zeros=count_zeros,
            expert_tp_rank=expert_tp_rank,
        )  # fmt: skip
        self.model, self.dp_group, self.dp_size = model, model.dp_group, model.dp_size
        self.mp_group = mp_group
        self.reduce_groups = (self.dp_group, mp_group)
        self.expert_reduce_groups = (model.expert_dp_group, expert_mp_group)
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        self.buffers = [
            _ShardedBuffer(d, g, dp_size=g.dp_size, dp_rank=g.dp_rank)
            for d, g in model.buffer_pairs()
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
                if lo >= hi:
                    continue
                n = hi - lo
                master = nn.Parameter(sb.master_view(lo, shard_lo + lo - s_lo, n))
                self.pieces.append(
                    _Piece(
                        param, b, group_of[param], lo - p_lo, hi - p_lo, lo,
                        shard_lo + lo - s_lo, master, self.is_counted(param),
                        self.zeros_counted(param), sb.grad_buffer.expert,
                    )
                )  # fmt: skip
        if len(seen) != len(group_of):
            raise ValueError(
                f"{len(group_of) - len(seen)} optimized parameters have no grad buffer"
            )
        self.optimizer = build_inner(
            [
                {**g, "params": [pc.master for pc in self.pieces if pc.group == i]}
                for i, g in enumerate(param_groups)
            ]
        )
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"ZeRO-1 shards Adam states; got {type(self.optimizer).__name__}")
        for pc in self.pieces:  # the Adam states are views of the flat per-buffer shards
            sb, s, n = self.buffers[pc.buffer], pc.shard_lo, pc.hi - pc.lo
            self.optimizer.state[pc.master] = {
                "step": torch.zeros((), dtype=torch.float32, device=self._step_device(pc.group)),
                "exp_avg": sb.exp_avg[s : s + n],
                "exp_avg_sq": sb.exp_avg_sq[s : s + n],
            }
        self.steps = 0
        self._agree_on_experts()

    def _step_device(self, group: int) -> torch.device:
        g = self.optimizer.param_groups[group]
        on_device = g.get("fused") or g.get("capturable")
        return self.buffers[0].param_data.device if on_device else torch.device("cpu")

    @property
    def master_params(self) -> list[nn.Parameter]:
        """This rank's fp32 pieces (views of the master shards)."""
        return [pc.master for pc in self.pieces]

    def zero_grad(self) -> None:
        """Drop the master grads and the fp32 grad copy (the grad buffer is zeroed by the model)."""
        super().zero_grad()
        for sb in self.buffers:
            sb.grad_flat = None

    # --- the step (MixedPrecisionOptimizer.step) --------------------------------------------------

    def _prepare_grads(self) -> StepGrads:
        self.model.finish_param_sync()  # no param all-gather may still write the buffers
        segments = [g for sb in self.buffers for g in sb.fp32_grad_segments()]
        grads = [
            self.buffers[pc.buffer].grad_view(pc.buffer_lo, pc.shard_lo, pc.hi - pc.lo)
            for pc in self.pieces
        ]
        for pc, g in zip(self.pieces, grads):
            pc.master.grad = g
        counted = [g for pc, g in zip(self.pieces, grads) if pc.counted and not pc.expert]
        zeros = [g for pc, g in zip(self.pieces, grads) if pc.zeros_counted and not pc.expert]
        counted_expert = [g for pc, g in zip(self.pieces, grads) if pc.counted and pc.expert]
        zeros_expert = [g for pc, g in zip(self.pieces, grads) if pc.zeros_counted and pc.expert]
        return StepGrads(segments, counted, zeros, counted_expert, zeros_expert)

    def _update_model_params(self) -> None:
        self.steps += 1
        self.update_model_params()

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].param_data.device if self.buffers else torch.device("cpu")

    def update_model_params(self) -> None:
        """Masters -> this rank's shard of the param buffer (rounded), then all-gather over DP."""
        for sb in self.buffers:
            if sb.master is not None:
                for (lo, hi, _), m in zip(sb.segments, sb.master_segments()):
                    sb.param_data[lo:hi].copy_(m)
        self.model.gather_params()

    def set_step(self, step: int) -> None:
        """The Adam step count of every piece (after loading a state)."""
        self.steps = step
        for pc in self.pieces:
            self.optimizer.state[pc.master]["step"].fill_(float(step))

    # --- checkpoints (the sharded format is in megalite.core.optimizer.zero1_checkpoint) ---------

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
                    param_dtype=sb.param_data.dtype,
                    names=[self.name_of[p] for p in params],
                    shapes=[p.shape for p in params],
                )
            )
        return out

    def sharded_state_dict(self) -> dict:
        """This DP rank's range only (copies; no communication)."""
        self.model.finish_param_sync()
        buffers = [
            {**layout, **{key: sb.shard_of(key).float().clone() for key in ckpt.STATE_KEYS}}
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
            for (lo, hi, s), m in zip(sb.segments, sb.master_segments()):
                m.copy_(saved["master"][s : s + hi - lo])
            for key in ADAM_KEYS:
                getattr(sb, key).copy_(saved[key])
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
                if key == "master" and sb.master is None:  # fp32 params: the buffer is current
                    fulls[key] = sb.param_data.detach().clone()
                else:
                    g = sb.grad_buffer
                    fulls[key] = ckpt.gather_full(
                        g.layout, sb.shard_of(key), dp_group=g.dp_group, dp_size=g.dp_size,
                        dp_rank=g.dp_rank,
                    )  # fmt: skip
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
        for pc in self.pieces:
            entry, sb, n = params[self.name_of[pc.param]], self.buffers[pc.buffer], pc.hi - pc.lo
            pc.master.copy_(entry["master"].reshape(-1)[pc.lo : pc.hi])
            for key in ADAM_KEYS:
                getattr(sb, key)[pc.shard_lo : pc.shard_lo + n].copy_(
                    entry[key].reshape(-1)[pc.lo : pc.hi]
                )
        for p in self.model_params:  # every rank has the full masters: no gather needed
            p.copy_(params[self.name_of[p]]["master"])
        self._load_step_and_scaler(sd["step"], sd.get("scaler"))

    def _load_step_and_scaler(self, step, scaler: dict | None) -> None:
        self.set_step(int(step))
        if self.loss_scaler is not None and scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
