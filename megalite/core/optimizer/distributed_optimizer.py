"""ZeRO-1: fp32 master parameters and Adam states sharded over the data-parallel group.

    model = ShardedDataParallel(module, dp_group=ps.dp_group, ...)
    optimizer = build_distributed_optimizer(model, lr=..., weight_decay=..., mp_group=ps.mp_group)
    ... forward_backward; model.finish_grad_sync(); optimizer.step()

Same interface as ``MixedPrecisionOptimizer`` (``step() -> (update_successful, grad_norm,
num_zeros)``, ``zero_grad``, ``param_groups``, ``scale_loss``, ``get_loss_scale``, state dicts), so
the training loop does not branch. Per-rank memory for ``P`` parameters (this model-parallel
rank) and DP size ``d``: the model's params (2P bytes in bf16) and grad buffer (4P in fp32) as
without ZeRO, plus ``12P/d`` of optimizer state (master + exp_avg + exp_avg_sq) instead of ``12P``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.zero_grad_sync import ShardedDataParallel
from megalite.core.optimizer import zero_state
from megalite.core.optimizer.clip_grads import clip_grads_by_norm, param_is_counted
from megalite.core.optimizer.full_state import param_names
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.optimizer import adamw_factory, get_param_groups
from megalite.core.tensor_parallel.mappings import group_size

full_state_from_shards = zero_state.full_state_from_shards  # offline: DP files -> full state


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
    counted: bool  # enters the grad norm (see clip_grads.param_is_counted)
    zeros_counted: bool  # enters num_zeros_in_grad


class _ShardedBuffer:
    """This DP rank's shard of one param dtype's buffers: ``segments`` = one
    ``(buffer_lo, buffer_hi, shard_lo)`` per bucket; the shard is their concatenation."""

    def __init__(self, model: ShardedDataParallel, param_data: torch.Tensor, grad_buffer):
        self.param_data, self.grad_buffer = param_data, grad_buffer
        self.segments, offset = [], 0
        for bucket in grad_buffer.buckets:
            lo, hi = model.shard_range(bucket)
            self.segments.append((lo, hi, offset))
            offset += hi - lo
        self.numel = offset
        device = param_data.device
        # fp32 params are their own masters: the shard of the param buffer is updated in place
        self.master = None
        if param_data.dtype != torch.float32:
            self.master = torch.empty(offset, dtype=torch.float32, device=device)
            for (lo, hi, _), m in zip(self.segments, self.master_segments()):
                m.copy_(param_data[lo:hi])
        self.exp_avg = torch.zeros(offset, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32, device=device)
        self.grad_flat: torch.Tensor | None = None  # fp32 copy of 16-bit grads during step()

    def master_segments(self) -> list[torch.Tensor]:
        if self.master is None:
            return [self.param_data[lo:hi] for lo, hi, _ in self.segments]
        return [self.master[s : s + hi - lo] for lo, hi, s in self.segments]

    def master_view(self, buffer_lo: int, shard_lo: int, n: int) -> torch.Tensor:
        if self.master is None:
            return self.param_data[buffer_lo : buffer_lo + n]
        return self.master[shard_lo : shard_lo + n]

    def fp32_grad_segments(self) -> list[torch.Tensor]:
        """The DP-reduced grads of this shard in fp32 (views of the grad buffer when it is fp32)."""
        data = self.grad_buffer.data
        if data.dtype == torch.float32:
            return [data[lo:hi] for lo, hi, _ in self.segments]
        self.grad_flat = torch.empty(self.numel, dtype=torch.float32, device=data.device)
        out = [self.grad_flat[s : s + hi - lo] for lo, hi, s in self.segments]
        for (lo, hi, _), g in zip(self.segments, out):
            g.copy_(data[lo:hi])
        return out

    def grad_view(self, buffer_lo: int, shard_lo: int, n: int) -> torch.Tensor:
        if self.grad_flat is None:
            return self.grad_buffer.data[buffer_lo : buffer_lo + n]
        return self.grad_flat[shard_lo : shard_lo + n]


class DistributedOptimizer:
    """ZeRO-1 Adam over the shards of a ``ShardedDataParallel`` model. Who owns what:

    - every DP rank holds the whole model (params in the param dtype) and a whole grad buffer;
    - DP rank ``r`` owns, in every bucket of every buffer, the ``r``-th of ``dp_size`` equal
      contiguous shards (``ShardedDataParallel.shard_range``); for that shard, and only for it, it
      holds the fp32 master params (unless the params are fp32: then the param buffer's shard is
      the master), ``exp_avg`` and ``exp_avg_sq``, each one flat fp32 tensor per buffer, the
      shards of all buckets concatenated; and only it updates those elements. A parameter cut by
      a shard boundary is updated in parts by two ranks (a ``_Piece`` each);
    - after the update each rank's shard of the param buffer is all-gathered over DP.

    ``step()``: fp32 grads of the shard (views, or a copy of 16-bit grads) -> unscale and inf/NaN
    check (the flag max-reduced over DP and the model-parallel group) -> grad norm (squares summed
    over the shard, then over DP and the model-parallel group; each parameter counted once as in
    ``clip_grads``) and clipping -> the inner Adam on the pieces -> masters into the param buffer ->
    all-gather. ``build_inner(groups)`` must return ``torch.optim.Adam`` or ``AdamW``.
    """

    is_sharded = True  # each DP rank holds its shard: checkpoints write distrib_optim files

    def __init__(
        self,
        param_groups: list[dict],
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        model: ShardedDataParallel,
        clip_grad: float,
        mp_group,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
    ):
        if not isinstance(model, ShardedDataParallel):
            raise TypeError("DistributedOptimizer needs the model wrapped in ShardedDataParallel")
        self.model, self.dp_group, self.dp_size = model, model.dp_group, model.dp_size
        self.clip_grad, self.mp_group, self.tp_rank = clip_grad, mp_group, tp_rank
        self.loss_scaler, self.count_zeros = loss_scaler, count_zeros
        self.names = param_names(model)
        duplicates = list(duplicates)
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        self.model_params = [p for g in param_groups for p in g["params"]]
        self.buffers = [_ShardedBuffer(model, d, g) for d, g in model.buffer_pairs()]
        self.pieces: list[_Piece] = []
        seen = set()
        for b, sb in enumerate(self.buffers):
            for param, (p_lo, p_hi, k) in sb.grad_buffer.param_ranges.items():
                if param not in group_of:
                    raise ValueError(f"parameter {self.names[param]} is in no param group")
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
                        shard_lo + lo - s_lo, master,
                        param_is_counted(param, tp_rank=tp_rank, duplicates=duplicates),
                        bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0,
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

    def _step_device(self, group: int) -> torch.device:
        g = self.optimizer.param_groups[group]
        on_device = g.get("fused") or g.get("capturable")
        return self.buffers[0].param_data.device if on_device else torch.device("cpu")

    # --- what the training loop uses -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    @property
    def master_params(self) -> list[nn.Parameter]:
        """This rank's fp32 pieces (views of the master shards)."""
        return [pc.master for pc in self.pieces]

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1) if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.loss_scaler is None:
            return loss
        return loss * self.loss_scaler.scale.to(loss.device)

    def zero_grad(self) -> None:
        """Drop the master grads and the fp32 grad copy (the grad buffer is zeroed by the model)."""
        for pc in self.pieces:
            pc.master.grad = None
        for sb in self.buffers:
            sb.grad_flat = None
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor | None, int | None]:
        self.model.finish_param_sync()  # no param all-gather may still write the buffers
        segments = [g for sb in self.buffers for g in sb.fp32_grad_segments()]
        grads = [
            self.buffers[pc.buffer].grad_view(pc.buffer_lo, pc.shard_lo, pc.hi - pc.lo)
            for pc in self.pieces
        ]
        if self.loss_scaler is not None:
            found_inf = self._unscale_and_check(segments)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = self._grad_norm([g for pc, g in zip(self.pieces, grads) if pc.counted])
        if self.clip_grad > 0:
            clip_grads_by_norm(segments, grad_norm, self.clip_grad)
        num_zeros = self._count_zeros(grads) if self.count_zeros else None
        for pc, g in zip(self.pieces, grads):
            pc.master.grad = g
        self.optimizer.step()
        self.steps += 1
        self.update_model_params()
        return True, grad_norm, num_zeros

    # --- the pieces -------------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over DP (each rank holds a shard), then over the model-parallel group."""
        for group in (self.dp_group, self.mp_group):
            if group_size(group) > 1:
                dist.all_reduce(t, op=op, group=group)
        return t

    def _unscale_and_check(self, segments: list[torch.Tensor]) -> bool:
        scaler = self.loss_scaler
        device = segments[0].device if segments else scaler.scale.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if segments:
            torch._amp_foreach_non_finite_check_and_unscale_(
                segments, found_inf, scaler.inv_scale.to(device)
            )
        return bool(self._all_reduce(found_inf, dist.ReduceOp.MAX).item() > 0)

    def _grad_norm(self, counted: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the unsharded model's grads (fp32 0-d tensor, no host sync)."""
        squares = torch.zeros((), dtype=torch.float32, device=self._device)
        if counted:
            squares = torch.stack(torch._foreach_norm(counted)).float().square().sum()
        return self._all_reduce(squares).sqrt()

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        zeros = torch.zeros((), dtype=torch.float32, device=self._device)
        for pc, g in zip(self.pieces, grads):
            if pc.zeros_counted:
                zeros = zeros + (g == 0).sum()
        return int(self._all_reduce(zeros).item())

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].param_data.device if self.buffers else torch.device("cpu")

    # --- checkpoints (the formats are in megalite.core.optimizer.zero_state) --------------------

    def state_dict(self) -> dict:
        """What ``distrib_optim.pt`` holds: ``sharded_state_dict()``."""
        return self.sharded_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_sharded_state_dict(state)

    def sharded_state_dict(self) -> dict:
        """This DP rank's range only (copies; no communication)."""
        return zero_state.sharded_state_dict(self)

    def load_sharded_state_dict(self, sd: dict) -> None:
        """Inverse of ``sharded_state_dict`` on the same DP size and buckets; the model params are
        then rebuilt from the masters (an all-gather: every DP rank calls it)."""
        zero_state.load_sharded_state_dict(self, sd)

    def full_state_dict(self, *, copy: bool = True) -> dict:
        """Layout-independent state (``megalite.core.optimizer.full_state``), gathered over DP:
        a collective, every DP rank calls it and gets the same dict."""
        return zero_state.full_state_dict(self)

    def load_full_state_dict(self, sd: dict) -> None:
        """Inverse of ``full_state_dict`` (from either optimizer, any DP size): each DP rank keeps
        its range; the model params are set from the full masters (no communication)."""
        zero_state.load_full_state_dict(self, sd)

    def set_step(self, step: int) -> None:
        """The Adam step count of every piece (after loading a state)."""
        self.steps = step
        for pc in self.pieces:
            self.optimizer.state[pc.master]["step"].fill_(float(step))

    def update_model_params(self) -> None:
        """Masters -> this rank's shard of the param buffer (rounded), then all-gather over DP."""
        for sb in self.buffers:
            if sb.master is not None:
                for (lo, hi, _), m in zip(sb.segments, sb.master_segments()):
                    sb.param_data[lo:hi].copy_(m)
        self.model.gather_params()


def build_distributed_optimizer(
    model: ShardedDataParallel,
    *,
    lr: float,
    weight_decay: float,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    mp_group=None,
    tp_rank: int = 0,
    duplicates: Iterable[torch.Tensor] = (),
    loss_scaler: LossScaler | None = None,
    count_zeros: bool = False,
) -> DistributedOptimizer:
    """``build_optimizer``'s AdamW and weight-decay groups, sharded (ZeRO-1)."""

    build_inner = adamw_factory(
        lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
        adam_eps=adam_eps,
    )  # fmt: skip
    return DistributedOptimizer(
        get_param_groups(model, weight_decay=weight_decay),
        build_inner,
        model=model,
        clip_grad=clip_grad,
        mp_group=mp_group,
        tp_rank=tp_rank,
        duplicates=duplicates,
        loss_scaler=loss_scaler,
        count_zeros=count_zeros,
    )
