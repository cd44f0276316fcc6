"""Optimizer offload (``OffloadSpec``) in one process: where the state lives, and that the step is
the same.

- host offload, fraction 1 and 0.4 (``--optimizer-offload-fraction``): the offloaded pieces' Adam
  states and masters are views of the host storages, the rest of the device ones (a piece cut at
  the boundary is split); 5 clipped steps = ``torch.optim.AdamW`` + ``clip_grad_norm_`` (1e-6),
  fp32 and ZeRO-3; bf16 = ZeRO-1 without offload (masters 1e-6).
- NVMe (``OffloadSpec(directory=...)``): the state is in three files of the shard's size, no Adam
  state on the host; 5 steps = the reference (1e-6), each reading every state file once per chunk
  of the store (chunks span parameter pieces); the full state round-trips through a checkpoint;
  amsgrad (a maximum the files do not keep) is refused.
- bounded host memory: a 2.4M-parameter layer whose optimizer state on disk (29 MB) is 12x the
  2 MiB bound; the peak RSS growth during ``step()`` (sampled every 0.2 ms) stays under the bound.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from megalite.core.distributed import Zero1DataParallel, wrapper_class
from megalite.core.optimizer import OffloadSpec, ShardedOptimizer, build_sharded_optimizer
from tests.core import zero_cases as zc

REL = 1e-6


def setup(offload, dtype=torch.float32, rung="optim"):
    model = wrapper_class(rung)(
        zc.tiny(dtype),
        dp_group=None,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=zc.BUCKET,
    )
    opt = build_sharded_optimizer(
        model,
        lr=zc.LR,
        weight_decay=zc.WD,
        clip_grad=zc.CLIP if dtype == torch.float32 else 0.0,
        offload=offload,
    )
    return model, opt


def train(model, opt, steps=range(5)) -> list[torch.Tensor]:
    for step in steps:
        zc.train_step(model, opt, step, parts=2)
    with model.gathered_params():
        return [p.detach().clone() for p in model.module.parameters()]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_host_offload_places_state_on_the_host_and_steps_the_same():
    ref, _ = zc.torch_reference(5)
    for fraction in (1.0, 0.4):
        for rung in ("optim", "optim_grads_params"):
            model, opt = setup(OffloadSpec(fraction=fraction), rung=rung)
            places = {pc.where for pc in opt.pieces}
            assert places == ({"host"} if fraction == 1.0 else {"host", "device"}), places
            for pc in opt.pieces:
                sb, state = opt.buffers[pc.buffer], opt.optimizer.state[pc.master]
                home = sb.host if pc.where == "host" else {"exp_avg": sb.exp_avg}
                assert _same_storage(state["exp_avg"], home["exp_avg"])
                if pc.where == "host":
                    assert _same_storage(pc.master, sb.host["master"])
            cut = opt.buffers[0].cut
            assert cut == round(fraction * opt.buffers[0].numel)
            got = train(model, opt)
            for g, r in zip(got, ref):
                assert zc.rel_err(g, r) <= REL, (fraction, rung, zc.rel_err(g, r))
    # bf16: the same masters as ZeRO-1 without offload
    plain = setup(None, torch.bfloat16)
    off = setup(OffloadSpec(fraction=0.5), torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(train(*plain), train(*off)))
    a, b = plain[1].full_state_dict()["params"], off[1].full_state_dict()["params"]
    for name in a:
        assert zc.rel_err(b[name]["master"], a[name]["master"]) <= REL, name


def test_nvme_offload_keeps_the_state_in_files_and_steps_the_same(tmp_path):
    ref, _ = zc.torch_reference(5)
    spec = OffloadSpec(fraction=1.0, directory=str(tmp_path), host_bytes=24 * 50)
    model, opt = setup(spec)
    sb = opt.buffers[0]
    assert {pc.where for pc in opt.pieces} == {"disk"} and not sb.host
    assert sb.exp_avg.numel() == 0 and opt.optimizer.state == {}
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and all(os.path.getsize(tmp_path / f) == sb.numel * 4 for f in files)
    assert sb.bytes_by_place() == {"device": 0, "host": 4 * 50 * 4, "disk": 12 * sb.numel}
    reads, read = [], sb.store._read
    sb.store._read = lambda key, lo, view: (reads.append(key), read(key, lo, view))
    got = train(model, opt)
    for g, r in zip(got, ref):
        assert zc.rel_err(g, r) <= REL, zc.rel_err(g, r)
    chunks = -(-sb.numel // sb.store.chunk)  # the pieces cover the shard, no padding at DP 1
    assert len(reads) == 5 * 3 * chunks, (len(reads), chunks)  # per chunk, not per piece
    full = opt.full_state_dict()  # checkpoint round trip through the files
    model2, opt2 = setup(OffloadSpec(fraction=0.5, directory=str(tmp_path / "b")))
    opt2.load_full_state_dict(full)
    for name, entry in opt2.full_state_dict()["params"].items():
        for key, value in entry.items():
            assert torch.equal(value, full["params"][name][key]), (name, key)


def test_nvme_offload_refuses_amsgrad(tmp_path):
    model = Zero1DataParallel(zc.tiny(), dp_group=None, bucket_size=zc.BUCKET)
    spec = OffloadSpec(directory=str(tmp_path))
    params = list(model.module.parameters())
    with pytest.raises(ValueError, match="amsgrad"):
        ShardedOptimizer(
            [{"params": params}],
            lambda groups: torch.optim.AdamW(groups, amsgrad=True),
            model=model,
            clip_grad=0.0,
            mp_group=None,
            tp_rank=0,
            offload=spec,
        )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_nvme_offload_peak_host_memory_stays_under_its_bound(tmp_path):
    torch.manual_seed(0)
    bound = 2 << 20
    layer = nn.Linear(1536, 1536)  # 2.36M params: 28 MB of fp32 master + moments on disk
    model = Zero1DataParallel(layer, dp_group=None)
    spec = OffloadSpec(fraction=1.0, directory=str(tmp_path), host_bytes=bound)
    opt = build_sharded_optimizer(model, lr=1e-3, weight_decay=0.1, offload=spec)
    disk = opt.buffers[0].bytes_by_place()["disk"]
    assert disk >= 12 * bound
    x = torch.randn(4, 1536)
    model.zero_grad_buffer()
    model(x).square().mean().backward()
    model.finish_grad_sync()
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    before = _rss()
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        ok, norm, _ = opt.step()
    finally:
        stop.set()
        thread.join()
    assert ok and float(norm) > 0
    growth = peak[0] - before
    assert growth < bound, (growth, bound)
