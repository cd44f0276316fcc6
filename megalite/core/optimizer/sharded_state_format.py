"""The sharded optimizer's checkpoint format (``distrib_optim_*.pt``: one file per DP rank, the
same on every sharded rung, ZeRO-1, 2 and 3), and its conversion to the full (layout-free) form.
Works on grad buffers, their layouts and plain tensors only: the ``ShardedOptimizer`` calls it, it
never imports the optimizer.

Sharded (``ShardedOptimizer.sharded_state_dict``)::

    {"format": "megalite-zero1-v1", "dp_size": d, "dp_rank": r, "step": int,
     "param_groups": [{lr, weight_decay, betas, ...}], "scaler": dict | None,
     "buffers": [                                   # one per param dtype, the model's order
        {"param_dtype": "torch.bfloat16", "numel": N, "bucket_numels": [n_0, n_1, ...],
         "params": [{"name": str, "shape": [...], "start": int}],   # where each param sits
         "master": fp32 [N/d], "exp_avg": fp32 [N/d], "exp_avg_sq": fp32 [N/d]}]}

``master`` etc. are this rank's shard of every bucket, concatenated: elements
``[o_k + r n_k/d, o_k + (r+1) n_k/d)`` of the buffer for bucket ``k`` at offset ``o_k``, in bucket
order (``GradBufferLayout.shard_segments``). The layout entries make a file self-describing:
``full_state_from_shards`` rebuilds the full form from the ``d`` files of one model-parallel shard
without building a model.

Full: see ``megalite.core.optimizer.full_state_format`` (shared with ``UnshardedOptimizer``).
"""

from __future__ import annotations

import math

import torch

from megalite.core.distributed.grad_buffer import GradBuffer, GradBufferLayout
from megalite.core.distributed.shard_collectives import all_gather_shard
from megalite.core.optimizer.full_state_format import ADAM_KEYS

FORMAT = "megalite-zero1-v1"  # the name files have carried since ZeRO-1; every rung writes it
STATE_KEYS = ("master", *ADAM_KEYS)


def layout_entry(
    layout: GradBufferLayout,
    *,
    param_dtype: torch.dtype,
    names: list[str],
    shapes: list,
    expert: bool = False,
) -> dict:
    """The self-describing part of one buffer's entry; ``names`` / ``shapes`` in the layout's
    parameter (registration) order. ``expert``: an MoE expert buffer, sharded over edp (not over
    the files' dp x cp), whose state checkpoints keep whole in their ``experts/`` files."""
    order = sorted(range(len(names)), key=lambda i: layout.param_ranges[i][0])
    extra = {"expert": True} if expert else {}  # absent means dense (also in files older than MoE)
    return {
        **extra,
        "param_dtype": str(param_dtype),
        "numel": layout.numel,
        "bucket_numels": [b.numel for b in layout.buckets],
        "params": [
            {"name": names[i], "shape": list(shapes[i]), "start": layout.param_ranges[i][0]}
            for i in order
        ],
    }


def check_format(sd: dict) -> None:
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"not a sharded optimizer state (format {got!r}, expected {FORMAT!r})")


def check_loadable(sd: dict, *, dp_size: int, dp_rank: int, layouts: list[dict]) -> None:
    """One-line ValueError unless ``sd`` is DP rank ``dp_rank`` of ``dp_size`` with ``layouts``."""
    check_format(sd)
    if (sd["dp_size"], sd["dp_rank"]) != (dp_size, dp_rank):
        raise ValueError(
            f"distrib_optim state of DP rank {sd['dp_rank']} of {sd['dp_size']} loaded on DP rank "
            f"{dp_rank} of {dp_size}; use the same DP size, or go through the full state "
            "(full_state_from_shards + load_full_state_dict)"
        )
    saved = [{k: b[k] for k in cur if k in b} for b, cur in zip(sd["buffers"], layouts)]
    if len(sd["buffers"]) != len(layouts) or saved != layouts:
        raise ValueError(
            "distrib_optim state was saved with another buffer layout (bucket sizes "
            f"{[b['bucket_numels'] for b in sd['buffers']]}, here "
            f"{[b['bucket_numels'] for b in layouts]}); use the same bucket_size and model, or "
            "go through the full state"
        )


def gather_full(grad_buffer: GradBuffer, shard: torch.Tensor) -> torch.Tensor:
    """The whole buffer [N] in fp32 from every rank's flat ``shard`` of ``grad_buffer`` (a
    collective over the buffer's DP group)."""
    g, layout = grad_buffer, grad_buffer.layout
    full = torch.zeros(layout.numel, dtype=torch.float32, device=shard.device)
    for (lo, hi, s), bucket in zip(layout.shard_segments(g.dp_size, g.dp_rank), layout.buckets):
        full[lo:hi].copy_(shard[s : s + hi - lo])
        all_gather_shard(full[bucket.offset : bucket.offset + bucket.numel], g.dp_group)
    return full


def full_state_buffers(optimizer, *, expert: bool) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {"master", "exp_avg", "exp_avg_sq"}}`` (full over the buffer's DP group,
    fp32) of a sharded optimizer's expert buffers (``expert``) or dense ones: a collective over
    those buffers' DP groups (edp for experts), every rank of them calls it. ``optimizer``: a
    ``ShardedOptimizer`` (its ``buffers`` of ``ShardState`` and ``name_of``)."""
    optimizer.model.finish_param_sync()
    params = {}
    for sb in optimizer.buffers:
        g = sb.grad_buffer
        if bool(g.expert) != expert:
            continue
        fulls = {key: gather_full(g, sb.read_shard(key)) for key in STATE_KEYS}
        for param, (lo, hi, _) in g.param_ranges.items():
            params[optimizer.name_of[param]] = {
                k: v[lo:hi].view(param.shape).clone() for k, v in fulls.items()
            }
    return params


def full_state_from_shards(files: list[dict]) -> dict:
    """The full form from every DP rank's sharded state of one model-parallel shard, in DP order
    (offline: no process group, no model). Expert buffers (``"expert"`` in their entry) are
    sharded over edp, not over these files' dp x cp, and their state is whole in the checkpoint's
    ``experts/`` files: they are left out here."""
    if not files:
        raise ValueError("full_state_from_shards needs the distrib_optim state of every DP rank")
    for r, sd in enumerate(files):
        check_format(sd)
        if (sd["dp_size"], sd["dp_rank"]) != (len(files), r):
            raise ValueError(
                f"distrib_optim file {r} of {len(files)} is DP rank {sd['dp_rank']} of "
                f"{sd['dp_size']}; pass every DP rank's file in DP order"
            )
    d = len(files)
    params = {}
    for b, layout in enumerate(files[0]["buffers"]):
        if layout.get("expert"):
            continue
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
            lo, numel = entry["start"], math.prod(entry["shape"])
            params[entry["name"]] = {
                k: v[lo : lo + numel].view(entry["shape"]).clone() for k, v in fulls.items()
            }
    return {"params": params, "step": int(files[0]["step"]), "scaler": files[0]["scaler"]}
