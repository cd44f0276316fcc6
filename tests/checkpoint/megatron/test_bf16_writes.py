"""megalite writes bf16 checkpoints in Megatron-LM's formats, as Megatron itself writes them.

megalite loads the bf16 fixtures (``test_bf16_fixtures``) at their own layout, TP 2 x PP 2 (4
ranks), and saves at once, with ``--bf16`` and ``--ckpt-format torch`` / ``torch_dist``, and
``torch`` under ``--use-distributed-optimizer``. Nothing trained in between, so each file must be
Megatron's file of the same state: the same structure (every key, the nesting of Megatron's
``Float16OptimizerWithFloat16Params``: ``optimizer`` + ``fp32_from_fp16_params`` and no
``grad_scaler`` under bf16; the ``(bf16, fp32)`` grad buffer of ``distrib_optim.pt``; every
``torch_dist`` tensor key with its dtype and global shape; ``common.pt``'s nesting) and the same
numbers: bf16 parameters, fp32 masters, Adam moments, steps and scheduler, bit for bit. Only what
says which program ran differs: ``args``, the lr a param group last used, the RNG states (megalite
ran on CPU) and what Megatron keeps in the padding between parameters. Under
``--grad-reduce-in-bf16`` the grad buffer is keyed ``(bf16, bf16)``, as Megatron keys it.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalite.checkpoint.megatron.distopt import (
    bucket_size_from_args,
    flat_layout,
    shared_embedding_name,
)
from megalite.checkpoint.megatron.legacy import Opaque, load_megatron_file, parameter_names
from megalite.core.parallel_state import ParallelState
from megalite.training import checkpoint_io
from tests.checkpoint.megatron.test_bf16_fixtures import BF16, SOURCES, load
from tests.harness import run_distributed
from tests.mesh import mesh

LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
SCHEDULE = ["--train-iters", "10"]  # the fixtures' run: the scheduler's numbers are Megatron's
# what says which program ran (or when), not the checkpoint's state
NOT_COMPARED = {"args", "rng_state", "lr", "num_floating_point_operations_so_far"}
ITER = "iter_0000002"


def _save_all(root: str) -> None:
    """4 ranks: each bf16 fixture loaded at TP 2 x PP 2 and saved at once in its own format."""
    ps = mesh(2, 2)
    try:
        for what, (name, extra) in SOURCES.items():
            path = os.path.join(BF16, name)
            flags = [*LAYOUT, *extra, *SCHEDULE, "--ckpt-format", what.split("+")[0]]
            trainer, _, _ = load(path, ps, *flags, world_size=4, rank=dist.get_rank())
            checkpoint_io.save_checkpoint(trainer, save_dir=os.path.join(root, what))
    finally:
        ps.destroy()


def differences(mine, theirs, path: str = "", *, values: bool = True) -> list[str]:
    """Where ``mine`` differs from ``theirs`` (Megatron's): keys, lengths, types, tensor dtypes,
    shapes and (``values``) numbers, recursively; ``NOT_COMPARED`` keys skipped."""
    if isinstance(theirs, dict):
        if not isinstance(mine, dict):
            return [f"{path}: {type(mine).__name__} where Megatron has a dict"]
        if set(mine) != set(theirs):
            return [f"{path}: keys {sorted(map(str, set(mine) ^ set(theirs)))} differ"]
        return [
            d
            for k in theirs
            if k not in NOT_COMPARED
            for d in differences(mine[k], theirs[k], f"{path}.{k}", values=values)
        ]
    if isinstance(theirs, (list, tuple)):
        if not isinstance(mine, (list, tuple)) or len(mine) != len(theirs):
            return [f"{path}: {mine!r:.60} vs Megatron's {theirs!r:.60}"]
        return [
            d
            for i, (a, b) in enumerate(zip(mine, theirs))
            for d in differences(a, b, f"{path}[{i}]", values=values)
        ]
    if isinstance(theirs, torch.Tensor):
        if not isinstance(mine, torch.Tensor) or (mine.dtype, mine.shape) != (
            theirs.dtype,
            theirs.shape,
        ):
            return [f"{path}: {getattr(mine, 'dtype', mine)} vs Megatron's {theirs.dtype}"]
        return [f"{path}: values differ"] if values and not torch.equal(mine, theirs) else []
    if isinstance(theirs, Opaque) or theirs is None and mine is None:
        return []
    if {type(mine), type(theirs)} == {int, float}:
        # the distributed optimizer's step: a float from Megatron without Transformer Engine or
        # Apex (the fixtures' machine), an int with them (GPUs) and from megalite
        return [f"{path}: {mine} vs Megatron's {theirs}"] if values and mine != theirs else []
    if type(mine) is not type(theirs) or (values and mine != theirs):
        return [f"{path}: {mine!r:.60} vs Megatron's {theirs!r:.60}"]
    return []


def _without_padding(distrib_optim: dict, raw: dict, pp_rank: int) -> dict:
    """``distrib_optim.pt``'s flat tensors with the alignment gaps between parameters zeroed
    (Megatron leaves whatever its buffers held there; no reader looks at them). ``raw``: the
    ``model_optim_rng.pt`` beside it (its parameters and bucket flags give the layout)."""
    model, args = raw["model"], raw["args"]
    params = [(n, model[n].numel()) for n in parameter_names(model)]
    bucket = bucket_size_from_args(args, pp_rank=pp_rank, stage_numel=sum(k for _, k in params))
    shared = shared_embedding_name(args, pp_rank, int(args.pipeline_model_parallel_size))
    spans, total = flat_layout(params, bucket_size=bucket, shared=shared)
    keep = torch.zeros(total, dtype=torch.bool)
    for start, end in spans.values():
        keep[start:end] = True
    return {
        **distrib_optim,
        0: {
            key: {k: v * keep if isinstance(v, torch.Tensor) else v for k, v in buf.items()}
            for key, buf in distrib_optim[0].items()
        },
    }


def test_megalite_bf16_files_are_megatrons_files_of_the_same_state(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_all, 4, root, timeout=600)
    bad = []
    for what in ("torch", "torch+distrib_optim"):
        for t in range(2):
            for p in range(2):
                shard = os.path.join(ITER, f"mp_rank_{t:02d}_{p:03d}")
                theirs_dir = os.path.join(BF16, SOURCES[what][0], shard)
                mine_dir = os.path.join(root, what, shard)
                mine = load_megatron_file(os.path.join(mine_dir, "model_optim_rng.pt"))
                theirs = load_megatron_file(os.path.join(theirs_dir, "model_optim_rng.pt"))
                bad += differences(mine, theirs, f"{what}/{shard}")
                entry, want = mine["rng_state"][0], theirs["rng_state"][0]  # their names
                if set(entry) != set(want) or set(entry["rng_tracker_states"]) != set(
                    want["rng_tracker_states"]
                ):
                    bad.append(f"{what}/{shard}.rng_state: {sorted(entry)} vs {sorted(want)}")
                if what == "torch+distrib_optim":
                    mine_o = load_megatron_file(os.path.join(mine_dir, "distrib_optim.pt"))
                    theirs_o = load_megatron_file(os.path.join(theirs_dir, "distrib_optim.pt"))
                    assert list(mine_o[0]) == [(torch.bfloat16, torch.float32)]
                    bad += differences(
                        _without_padding(mine_o, mine, p),
                        _without_padding(theirs_o, theirs, p),
                        f"{what}/{shard}/distrib_optim.pt",
                    )
    dist_dir = os.path.join(root, "torch_dist", ITER)
    theirs_dist = os.path.join(BF16, SOURCES["torch_dist"][0], ITER)
    bad += differences(
        load_megatron_file(os.path.join(dist_dir, "common.pt")),
        load_megatron_file(os.path.join(theirs_dist, "common.pt")),
        "torch_dist/common.pt",
    )
    bad += differences(_dist_tensors(dist_dir), _dist_tensors(theirs_dist), "torch_dist")
    assert not bad, "\n".join(bad[:20])


def _dist_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole (the RNG and extra-state objects left out)."""
    reader = dcp.FileSystemReader(folder)
    index = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in index.items()
        if hasattr(m, "size")
    }
    with warnings.catch_warnings():  # "assuming ... a single process": so it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def test_grad_reduce_in_bf16_keys_the_grad_buffer_as_megatron(tmp_path):
    """Megatron keys a distributed optimizer's buffer by (param dtype, grad dtype): fp32 grads by
    default under --bf16, bf16 with --grad-reduce-in-bf16."""
    single = ParallelState.single()
    name, extra = SOURCES["torch+distrib_optim"]
    for flag, grad_dtype in (([], torch.float32), (["--grad-reduce-in-bf16"], torch.bfloat16)):
        save = str(tmp_path / str(grad_dtype))
        flags = [*extra, *flag, "--ckpt-format", "torch"]
        trainer, _, _ = load(os.path.join(BF16, name), single, *flags)
        checkpoint_io.save_checkpoint(trainer, save_dir=save)
        state = load_megatron_file(os.path.join(save, ITER, "mp_rank_00", "distrib_optim.pt"))
        assert list(state[0]) == [(torch.bfloat16, grad_dtype)], (flag, list(state[0]))
