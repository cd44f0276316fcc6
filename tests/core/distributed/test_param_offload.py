"""ZeRO-3 parameter offload (``ParamOffloadSpec``) and grad offload (``grad_offload``) against the
single-process references, on ``zero_cases.Tiny`` (one bucket per unit: emb, fc1, norm, fc2), DP 1
and 2.

- equivalence: with the param shards on the host, on the host with the optimizer (grads on the
  host too), and in files with the optimizer in files (1-element staging: every unit streamed in
  pieces), 5 fp32 steps of 2 micro-batches = ``clip_grad_norm_`` + ``torch.optim.AdamW`` (params
  and norms 1e-6); bf16 params, fp32 masters = bf16 ZeRO-3 without offload (params equal, masters
  1e-6).
- placement, counted from the storages: the host shards are the store's host tensors, and
  (fp32) the offloaded masters are those very storages (one copy); the grad shards are the host
  ones; with files, no param shard tensor exists, the optimizer has no master file (the param file
  is it), the file's bytes are this rank's params, and the host staging stays within its bound.
  In a training step the whole-unit bytes, counted from the parameters' storages at every op, peak
  at exactly the largest pair of neighbouring units (the computed one and the one read ahead), and
  nothing whole is left after.
- checkpoint: the full state saved while it is in files loads into ZeRO-3 at another DP size with
  its params in files, and into ZeRO-1 without offload, and both continue like the uninterrupted
  run (1e-6).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.core.distributed import ParamOffloadSpec, wrapper_class
from megalite.core.distributed.param_offload import ParamFile
from megalite.core.optimizer import OffloadSpec, build_sharded_optimizer
from tests.core import zero_cases as zc
from tests.core.distributed.test_zero2_zero3 import ParamStorageBytes, masters, params, run
from tests.harness import run_distributed

REL = 1e-6
Z3 = "optim_grads_params"


def setup(tmp: str, case: str, dtype=torch.float32, *, rung=Z3, tag=""):
    """(model, optimizer) of offload ``case``: none | host | host+optim | files."""
    rank = zc.dp_info()[0]
    param = optim = None
    if case in ("host", "host+optim"):
        param = ParamOffloadSpec()
    if case == "host+optim":
        optim = OffloadSpec()
    if case == "files":
        param = ParamOffloadSpec(directory=f"{tmp}/param{tag}{rank}", host_bytes=2 * 4)
        optim = OffloadSpec(directory=f"{tmp}/optim{tag}{rank}", host_bytes=24 * 7)
    options = {}
    if rung == Z3:
        options = {"param_offload": param, "grad_offload": optim is not None}
    model = wrapper_class(rung)(
        zc.tiny(dtype),
        dp_group=dist.group.WORLD if dist.is_initialized() else None,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=zc.BUCKET,
        **options,
    )
    clip = zc.CLIP if dtype == torch.float32 else 0.0
    opt = build_sharded_optimizer(
        model, lr=zc.LR, weight_decay=zc.WD, clip_grad=clip, offload=optim
    )
    return model, opt


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def placement(model, opt) -> dict:
    """Where the state is, from the storages and files themselves."""
    store = model.param_store
    shards = list(model.param_shards.values())
    out = {"files": [s.path for s in shards if isinstance(s, ParamFile)]}
    out["shards_on_host"] = all(
        not isinstance(s, ParamFile) and _ptr(s) in {_ptr(h) for h in store.host} for s in shards
    )
    host_pieces = [pc for pc in opt.pieces if pc.where == "host"]
    out["masters_are_shards"] = bool(host_pieces) and all(
        _ptr(pc.master) == _ptr(shards[pc.buffer]) for pc in host_pieces
    )
    out["grads_on_host"] = bool(model.host_grads) and [
        _ptr(b.data) for b in model.grad_buffers
    ] == [_ptr(g) for g in model.host_grads]
    out["optim_files"] = sorted(
        os.path.basename(p)
        for sb in opt.buffers
        if sb.store is not None
        for p in sb.store.paths.values()
    )
    out["staging_bytes"] = store.host_bytes if store.place == "disk" else 0
    return out


def file_holds_the_params(model) -> bool:
    """The param file's elements are this rank's part of every gathered unit."""
    (shard,) = model.param_shards.values()
    on_disk = torch.from_numpy(np.fromfile(shard.path, dtype=np.float32))
    (buffer,) = model.grad_buffers
    with model.gathered_params():
        ok = True
        for key in model._full:
            lo, hi, s = buffer.segments[key[1]]
            bucket = model._buckets[key]
            mine = model._full[key][lo - bucket.offset : hi - bucket.offset]
            ok = ok and torch.equal(mine, on_disk[s : s + hi - lo])
    return ok


def unit_peaks(model, opt) -> dict:
    """Whole-unit bytes in a training step, counted from the parameters' storages."""
    rank, dp = zc.dp_info()
    counter = ParamStorageBytes(model.module.parameters())
    model.zero_grad_buffer()
    opt.zero_grad()
    tokens, targets = zc.micro_batches(5, dp)[rank]
    before = counter.now()
    with counter:
        counter.phase = "forward"
        loss = opt.scale_loss(zc.loss_of(model, tokens, targets))
        counter.phase = "backward"
        loss.backward()
        counter.phase = "step"
        model.finish_grad_sync()
        ok, _, _ = opt.step()
    (units,) = [[b.numel for b in buf.layout.buckets] for buf in model.grad_buffers]
    pair = 4 * max(a + b for a, b in zip(units, units[1:]))
    return {
        "ok": ok,
        "before": before,
        "after": counter.now(),
        "pair": pair,
        "peak": {k: counter.peak[k] for k in ("forward", "backward")},
    }


def offload_cases(tmp: str) -> dict:
    out = {}
    for case in ("host", "host+optim", "files"):
        model, opt = setup(tmp, case)
        r = out[case] = {"placement": placement(model, opt)}
        r["steps"] = run(model, opt, range(5), micro=2)
        r["params"] = params(model)
        if case == "files":
            r["file_holds_params"] = file_holds_the_params(model)
        r["units"] = unit_peaks(model, opt)
        model, opt = setup(tmp, case, torch.bfloat16, tag="bf16")
        run(model, opt, range(5))
        r["bf16"] = (params(model), masters(opt))
    model, opt = setup(tmp, "none", torch.bfloat16)
    run(model, opt, range(5))
    out["none_bf16"] = (params(model), masters(opt))
    model, opt = setup(tmp, "files", tag="ckpt")
    run(model, opt, range(3))
    out["full_state"] = opt.full_state_dict()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda dp: f"dp{dp}")
def results(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"offload{request.param}"))
    if request.param == 1:
        return 1, [offload_cases(tmp)], tmp
    return request.param, run_distributed(offload_cases, request.param, tmp, timeout=600), tmp


def test_offloaded_steps_equal_torch_adamw_and_bf16_without_offload(results):
    dp, per_rank, _ = results
    ref_params, ref_norms = zc.torch_reference(5)
    for rank, out in enumerate(per_rank):
        plain_params, plain_masters = out["none_bf16"]
        for case in ("host", "host+optim", "files"):
            r = out[case]
            for (ok, norm), ref in zip(r["steps"], ref_norms):
                assert ok and abs(norm - ref) <= REL * ref, (dp, rank, case, norm, ref)
            for g, want in zip(r["params"], ref_params):
                assert zc.rel_err(g, want) <= REL, (dp, rank, case, zc.rel_err(g, want))
            got_params, got_masters = r["bf16"]
            assert all(torch.equal(a, b) for a, b in zip(got_params, plain_params)), (dp, case)
            for g, want in zip(got_masters, plain_masters):
                assert zc.rel_err(g, want) <= REL, (dp, rank, case, zc.rel_err(g, want))


def test_state_lives_where_the_offload_puts_it(results):
    dp, per_rank, tmp = results
    for rank, out in enumerate(per_rank):
        host, both, files = (out[c]["placement"] for c in ("host", "host+optim", "files"))
        assert host["shards_on_host"] and not host["files"] and not host["grads_on_host"]
        assert both["shards_on_host"] and both["masters_are_shards"] and both["grads_on_host"]
        assert not files["shards_on_host"] and files["grads_on_host"]
        (path,) = files["files"]
        assert os.path.dirname(path) == f"{tmp}/param{rank}" and path.endswith(".param")
        assert os.path.basename(path) in files["optim_files"]  # the param file is the master file
        assert not any(f.endswith(".master") for f in files["optim_files"]), files
        assert 0 < files["staging_bytes"] <= 2 * 4, files
        assert out["files"]["file_holds_params"]


def test_offloaded_units_are_whole_only_while_used_and_read_ahead(results):
    dp, per_rank, _ = results
    for out in per_rank:
        for case in ("host", "host+optim", "files"):
            u = out[case]["units"]
            assert u["ok"] and u["before"] == 0 and u["after"] == 0, (dp, case, u)
            assert u["peak"] == {"forward": u["pair"], "backward": u["pair"]}, (dp, case, u)


def resume_case(tmp: str, full: dict, case: str, rung: str) -> list[torch.Tensor]:
    model, opt = setup(tmp, case, rung=rung, tag=f"resume_{rung}")
    opt.load_full_state_dict(full)
    run(model, opt, range(3, 5))
    return params(model)


def test_state_saved_from_files_resumes_at_another_dp_size(results):
    """DP 1's state -> ZeRO-3 with files at DP 2 and ZeRO-1 at DP 2; DP 2's -> DP 1."""
    dp, per_rank, tmp = results
    ref_params, _ = zc.torch_reference(5)
    other = 2 if dp == 1 else 1
    full = per_rank[0]["full_state"]
    for case, rung in (("files", Z3), ("none", "optim")):
        if other == 1:
            outs = [resume_case(tmp, full, case, rung)]
        else:
            outs = run_distributed(resume_case, other, tmp, full, case, rung, timeout=600)
        for got in outs:
            for g, want in zip(got, ref_params):
                assert zc.rel_err(g, want) <= REL, (dp, other, case, zc.rel_err(g, want))
