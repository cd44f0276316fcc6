"""ZeRO-3's grad shards in files (``GradFiles``, ``grad_files``) against the same run with them on
the host, on ``zero_cases.Tiny`` (one bucket per unit; the LayerNorm unused on odd steps), DP 1
and 2, params, grads and optimizer state in files (1-element param staging, 7-element optimizer
chunks: every read and write streamed in pieces), 2 micro-batches per step (the second part of
each bucket is added to the file), 4 fp32 steps: grad norms and params within 1e-6 (the streamed
norm sums chunk norms: the last bits may differ), and the file holds this rank's grads: its bytes,
divided by the DP size and times the clip coefficient, equal the host run's clipped grad shard.

Cleanup: ``remove_offload_files`` deletes the param, grad and optimizer files and the directories
the stores made, and leaves a directory that existed (with a user's file in it).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from megalite.core.distributed import ParamOffloadSpec, Zero3DataParallel
from megalite.core.optimizer import OffloadSpec, build_sharded_optimizer
from tests.core import zero_cases as zc
from tests.core.distributed.test_zero2_zero3 import params, run
from tests.harness import run_distributed

REL = 1e-6
STEPS = range(4)


def setup(tmp: str, *, grad_files: bool):
    rank = zc.dp_info()[0]
    tag = f"{'files' if grad_files else 'host'}{rank}"
    model = Zero3DataParallel(
        zc.tiny(),
        dp_group=dist.group.WORLD,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=zc.BUCKET,
        param_offload=ParamOffloadSpec(directory=f"{tmp}/param{tag}", host_bytes=2 * 4),
        grad_offload=True,
        grad_files=grad_files,
    )
    offload = OffloadSpec(directory=f"{tmp}/optim{tag}", host_bytes=24 * 7)
    opt = build_sharded_optimizer(
        model, lr=zc.LR, weight_decay=zc.WD, clip_grad=zc.CLIP, offload=offload
    )
    return model, opt


def grad_files_case(tmp: str) -> dict:
    out = {}
    for grad_files in (False, True):
        model, opt = setup(tmp, grad_files=grad_files)
        norms = run(model, opt, STEPS, micro=2, before=zc.skip_norm_on_odd_steps)
        if grad_files:  # the last step's file: the DP sum of this rank's shard, unclipped
            (file,) = model.grad_files.files
            grads = torch.from_numpy(np.fromfile(file.path, dtype=np.float32))
            grads = grads / model.dp_size * opt.streamed.coefficient  # the host grads are clipped
        else:
            grads = model.grad_buffers[0].data.clone()
        out[grad_files] = {"norms": norms, "params": params(model), "grads": grads}
        if grad_files:
            out["grad_paths"] = [f.path for f in model.param_store.grad_files]
    return out


def test_grads_in_files_train_like_grads_on_the_host(tmp_path):
    for world in (1, 2):
        for rank_out in run_distributed(grad_files_case, world, str(tmp_path / f"w{world}")):
            host, files = rank_out[False], rank_out[True]
            assert [os.path.basename(p) for p in rank_out["grad_paths"]][0].endswith("_b0.grad")
            for (ok_h, n_h), (ok_f, n_f) in zip(host["norms"], files["norms"]):
                assert ok_h and ok_f and abs(n_f - n_h) <= REL * n_h, (world, n_h, n_f)
            for a, b in zip(files["params"], host["params"]):
                assert zc.rel_err(a, b) <= REL, (world, zc.rel_err(a, b))
            assert files["grads"].numel() == host["grads"].numel() > 0
            assert zc.rel_err(files["grads"], host["grads"]) <= REL, world


def cleanup_case(tmp: str) -> dict:
    rank = zc.dp_info()[0]
    kept = f"{tmp}/kept{rank}"
    os.makedirs(kept)
    with open(f"{kept}/user.txt", "w") as f:
        f.write("a user's file")
    model = Zero3DataParallel(
        zc.tiny(),
        dp_group=dist.group.WORLD,
        bucket_size=zc.BUCKET,
        param_offload=ParamOffloadSpec(directory=f"{tmp}/made{rank}/param"),
        grad_offload=True,
        grad_files=True,
    )
    opt = build_sharded_optimizer(
        model, lr=zc.LR, weight_decay=zc.WD, offload=OffloadSpec(directory=kept)
    )
    run(model, opt, range(1))
    before = sorted(os.listdir(kept)) + sorted(os.listdir(f"{tmp}/made{rank}/param"))
    opt.remove_offload_files()
    model.remove_offload_files()
    return {
        "before": before,
        "kept": sorted(os.listdir(kept)),
        "made": os.path.exists(f"{tmp}/made{rank}/param"),
    }


def test_remove_offload_files_deletes_what_the_stores_made(tmp_path):
    for out in run_distributed(cleanup_case, 2, str(tmp_path)):
        suffixes = {name.rsplit(".", 1)[-1] for name in out["before"]}
        assert suffixes == {"exp_avg", "exp_avg_sq", "param", "grad", "txt"}, out
        assert out["kept"] == ["user.txt"] and not out["made"], out
