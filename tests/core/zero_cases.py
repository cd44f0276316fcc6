"""Shared pieces of the ZeRO-1 tests: a tiny model whose parameters straddle shard and bucket
boundaries, the data each DP rank sees, and steppers for the distributed and reference optimizers.

The model has 337 parameters in 7 tensors (an embedding, two linears with biases, a LayerNorm);
with ``BUCKET`` = 40 elements the buffer has 3 buckets (154, 117 and 66 elements before padding),
and at DP 2 and 4 shard boundaries fall inside the weights, so they are updated in parts by two or
more ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.core.distributed import DistributedDataParallel, Zero1DataParallel
from megalite.core.optimizer import (
    DynamicLossScaler,
    build_optimizer,
    build_sharded_optimizer,
    get_param_groups,
)

BUCKET = 40
VOCAB, SEQ, GLOBAL_ROWS = 11, 4, 8
LR, WD, CLIP = 1e-2, 0.1, 0.5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.fc1 = nn.Linear(6, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, VOCAB)

    skip_norm = False  # the LayerNorm's params get no grad while set (an unused parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, vocab]
        h = torch.tanh(self.fc1(self.emb(tokens)))
        return self.fc2(h if self.skip_norm else self.norm(h))


def tiny(dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():  # LayerNorm starts away from (1, 0) so its grads matter
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model.to(dtype)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, targets # [GLOBAL_ROWS, SEQ] of step ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=g)
    return tokens, (tokens * 3 + 1) % VOCAB


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss_of_logits(model(tokens), targets)


def loss_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def micro_batches(step: int, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens, targets = global_batch(step)
    return list(zip(tokens.chunk(parts), targets.chunk(parts)))


def dp_info() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def zero_setup(
    dtype: torch.dtype = torch.float32,
    *,
    bucket: int = BUCKET,
    fp16_scale: float | None = None,
    clip: float = CLIP,
    fp32_grads: bool = True,
):
    """(Zero1DataParallel, ShardedOptimizer) over the world group (DP = world size)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    model = Zero1DataParallel(
        tiny(dtype),
        dp_group=group,
        accumulate_allreduce_grads_in_fp32=fp32_grads,
        bucket_size=bucket,
    )
    scaler = None if fp16_scale is None else DynamicLossScaler(fp16_scale, hysteresis=1)
    opt = build_sharded_optimizer(model, lr=LR, weight_decay=WD, clip_grad=clip, loss_scaler=scaler)
    return model, opt


def plain_setup(dtype: torch.dtype = torch.float32, *, fp16_scale: float | None = None):
    """The unsharded optimizer on one process (grad buffer in fp32, micro-batches)."""
    model = DistributedDataParallel(
        tiny(dtype), dp_group=None, accumulate_allreduce_grads_in_fp32=True, bucket_size=BUCKET
    )
    scaler = None if fp16_scale is None else DynamicLossScaler(fp16_scale, hysteresis=1)
    opt = build_optimizer(model, lr=LR, weight_decay=WD, clip_grad=CLIP, loss_scaler=scaler)
    return model, opt


def skip_norm_on_odd_steps(model, step: int) -> None:
    """A ``before`` callback of ``train_step``: the LayerNorm is unused on odd steps."""
    model.module.skip_norm = step % 2 == 1


def train_step(
    model, opt, step: int, *, parts: int, index: int | None = None, inject=None, before=None
):
    """One step on micro-batches: this DP rank's share of the global batch (``index`` of ``parts``
    rows-chunks), or every chunk accumulated (``index`` None, the single-process reference)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    if before is not None:
        before(model, step)
    batches = micro_batches(step, parts)
    chosen = batches if index is None else [batches[index]]
    backward_micro_batches(model, opt, chosen)
    if inject is not None:
        inject(model, step)
    model.finish_grad_sync()
    ok, norm, _ = opt.step()
    return ok, None if norm is None else float(norm)


def backward_micro_batches(model, opt, batches) -> None:
    """Each micro-batch's scaled mean-loss backward, all but the last inside ``model.no_sync()``
    (as the schedules run them)."""
    for i, (tokens, targets) in enumerate(batches):
        loss = opt.scale_loss(loss_of(model, tokens, targets) / len(batches))
        if i < len(batches) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()


def torch_reference(steps: int, *, clip: float = CLIP) -> tuple[list[torch.Tensor], list[float]]:
    """Plain PyTorch: the fp32 model on the whole global batch, ``clip_grad_norm_`` and
    ``torch.optim.AdamW`` with the same weight-decay groups. Returns the params and grad norms."""
    model = tiny()
    groups = get_param_groups(model, weight_decay=WD)
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *global_batch(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def params_of(model) -> list[torch.Tensor]:
    """The model's params, after any all-gather still in flight (overlap_param_gather)."""
    if hasattr(model, "finish_param_sync"):
        model.finish_param_sync()
    return [p.detach().clone() for p in model.module.parameters()]
