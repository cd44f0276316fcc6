"""The ZeRO-1 optimizer's checkpoint formats: one DP rank's range, and the full (layout-free) form.

Sharded (``DistributedOptimizer.sharded_state_dict``, what ``distrib_optim.pt`` holds)::

    {"format": "megalite-zero1-v1", "dp_size": d, "dp_rank": r, "step": int,
     "param_groups": [{lr, weight_decay, betas, ...}], "scaler": dict | None,
     "buffers": [                                   # one per param dtype, the model's order
        {"param_dtype": "torch.bfloat16", "numel": N, "bucket_numels": [n_0, n_1, ...],
         "params": [{"name": str, "shape": [...], "start": int}],   # where each param sits
         "master": fp32 [N/d], "exp_avg": fp32 [N/d], "exp_avg_sq": fp32 [N/d]}]}

``master`` etc. are this rank's shard of every bucket, concatenated: elements
``[o_k + r n_k/d, o_k + (r+1) n_k/d)`` of the buffer for bucket ``k`` at offset ``o_k``, in bucket
order. The layout entries make a file self-describing: ``full_state_from_shards`` rebuilds the full
form from the ``d`` files of one model-parallel shard without building a model.

Full: see ``megalite.core.optimizer.full_state`` (shared with ``MixedPrecisionOptimizer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megalite.core.distributed.shard_collectives import all_gather_shard
from megalite.core.optimizer.full_state import ADAM_KEYS, check_full_state

if TYPE_CHECKING:
    from megalite.core.optimizer.distributed_optimizer import DistributedOptimizer, _ShardedBuffer

FORMAT = "megalite-zero1-v1"
STATE_KEYS = ("master", *ADAM_KEYS)


def _layout(opt: DistributedOptimizer, sb: _ShardedBuffer) -> dict:
    ranges = sorted(sb.grad_buffer.param_ranges.items(), key=lambda item: item[1][0])
    return {
        "param_dtype": str(sb.param_data.dtype),
        "numel": sb.grad_buffer.numel,
        "bucket_numels": [b.data.numel() for b in sb.grad_buffer.buckets],
        "params": [
            {"name": opt.names[p], "shape": list(p.shape), "start": lo} for p, (lo, _, _) in ranges
        ],
    }


def _shard_of(sb: _ShardedBuffer, key: str) -> torch.Tensor:
    """This rank's flat fp32 shard [N/d] of ``key``."""
    if key != "master":
        return getattr(sb, key)
    if sb.master is not None:
        return sb.master
    segments = sb.master_segments()
    return torch.cat(segments) if segments else sb.exp_avg.new_empty(0)


def sharded_state_dict(opt: DistributedOptimizer) -> dict:
    opt.model.finish_param_sync()
    buffers = []
    for sb in opt.buffers:
        shards = {key: _shard_of(sb, key).float().clone() for key in STATE_KEYS}
        buffers.append({**_layout(opt, sb), **shards})
    return {
        "format": FORMAT,
        "dp_size": opt.dp_size,
        "dp_rank": opt.model.dp_rank,
        "buffers": buffers,
        "step": opt.steps,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
    }


def _check_format(sd: dict) -> None:
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"not a ZeRO-1 optimizer shard (format {got!r}, expected {FORMAT!r})")


@torch.no_grad()
def load_sharded_state_dict(opt: DistributedOptimizer, sd: dict) -> None:
    opt.model.finish_param_sync()
    _check_format(sd)
    if (sd["dp_size"], sd["dp_rank"]) != (opt.dp_size, opt.model.dp_rank):
        raise ValueError(
            f"distrib_optim state of DP rank {sd['dp_rank']} of {sd['dp_size']} loaded on DP rank "
            f"{opt.model.dp_rank} of {opt.dp_size}; use the same DP size, or go through the full "
            "state (full_state_from_shards + load_full_state_dict)"
        )
    layouts = [_layout(opt, sb) for sb in opt.buffers]
    saved = [{k: b[k] for k in layouts[0]} for b in sd["buffers"]] if layouts else sd["buffers"]
    if saved != layouts:
        raise ValueError(
            "distrib_optim state was saved with another buffer layout (bucket sizes "
            f"{[b['bucket_numels'] for b in sd['buffers']]}, here "
            f"{[b['bucket_numels'] for b in layouts]}); use the same --ddp-bucket-size and "
            "model, or go through the full state"
        )
    for sb, saved_buffer in zip(opt.buffers, sd["buffers"]):
        for (lo, hi, s), m in zip(sb.segments, sb.master_segments()):
            m.copy_(saved_buffer["master"][s : s + hi - lo])
        for key in ADAM_KEYS:
            getattr(sb, key).copy_(saved_buffer[key])
    for group, saved_group in zip(opt.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    opt.set_step(int(sd["step"]))
    if opt.loss_scaler is not None and sd.get("scaler") is not None:
        opt.loss_scaler.load_state_dict(sd["scaler"])
    opt.update_model_params()


def _gather_full(opt: DistributedOptimizer, sb: _ShardedBuffer, key: str) -> torch.Tensor:
    """The whole buffer [N] of ``key`` in fp32, from every DP rank's shard (all-gathers)."""
    if key == "master" and sb.master is None:  # fp32 params: the param buffer is up to date
        return sb.param_data.detach().clone()
    shard = _shard_of(sb, key)
    full = torch.zeros(sb.grad_buffer.numel, dtype=torch.float32, device=shard.device)
    for (lo, hi, s), bucket in zip(sb.segments, sb.grad_buffer.buckets):
        full[lo:hi].copy_(shard[s : s + hi - lo])
        all_gather_shard(full[bucket.offset : bucket.offset + bucket.data.numel()], opt.dp_group)
    return full


def full_state_dict(opt: DistributedOptimizer) -> dict:
    opt.model.finish_param_sync()
    params = {}
    for sb in opt.buffers:
        fulls = {key: _gather_full(opt, sb, key) for key in STATE_KEYS}
        for param, (lo, hi, _) in sb.grad_buffer.param_ranges.items():
            params[opt.names[param]] = {
                k: v[lo:hi].view(param.shape).clone() for k, v in fulls.items()
            }
    scaler = None if opt.loss_scaler is None else opt.loss_scaler.state_dict()
    return {"params": params, "step": opt.steps, "scaler": scaler}


@torch.no_grad()
def load_full_state_dict(opt: DistributedOptimizer, sd: dict) -> None:
    opt.model.finish_param_sync()
    check_full_state(sd, {opt.names[p]: p.shape for p in opt.model_params})
    params = sd["params"]
    for pc in opt.pieces:
        entry, sb, n = params[opt.names[pc.param]], opt.buffers[pc.buffer], pc.hi - pc.lo
        pc.master.copy_(entry["master"].reshape(-1)[pc.lo : pc.hi])
        for key in ADAM_KEYS:
            getattr(sb, key)[pc.shard_lo : pc.shard_lo + n].copy_(
                entry[key].reshape(-1)[pc.lo : pc.hi]
            )
    for p in opt.model_params:  # every rank has the full masters: no gather needed
        p.copy_(params[opt.names[p]]["master"])
    opt.set_step(int(sd["step"]))
    if opt.loss_scaler is not None and sd.get("scaler") is not None:
        opt.loss_scaler.load_state_dict(sd["scaler"])


def full_state_from_shards(files: list[dict]) -> dict:
    """The full form from every DP rank's sharded state of one model-parallel shard, in DP order
    (offline: no process group, no model)."""
    if not files:
        raise ValueError("full_state_from_shards needs the distrib_optim state of every DP rank")
    for r, sd in enumerate(files):
        _check_format(sd)
        if (sd["dp_size"], sd["dp_rank"]) != (len(files), r):
            raise ValueError(
                f"distrib_optim file {r} of {len(files)} is DP rank {sd['dp_rank']} of "
                f"{sd['dp_size']}; pass every DP rank's file in DP order"
            )
    d = len(files)
    params = {}
    for b, layout in enumerate(files[0]["buffers"]):
        fulls = {key: torch.zeros(layout["numel"], dtype=torch.float32) for key in STATE_KEYS}
        offset, shard_offset = 0, 0
        for n in layout["bucket_numels"]:
            size = n // d
            for r, sd in enumerate(files):
                for key, full in fulls.items():
                    part = sd["buffers"][b][key][shard_offset : shard_offset + size]
                    full[offset + r * size : offset + (r + 1) * size].copy_(part)
            offset, shard_offset = offset + n, shard_offset + size
        for entry in layout["params"]:
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            lo = entry["start"]
            params[entry["name"]] = {
                k: v[lo : lo + numel].view(entry["shape"]).clone() for k, v in fulls.items()
            }
    return {"params": params, "step": int(files[0]["step"]), "scaler": files[0]["scaler"]}
