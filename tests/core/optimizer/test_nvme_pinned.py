"""NVMe offload's host buffers on CUDA: pinned, copied without blocking, fenced before reuse.

No GPU: the store is given the device string "cuda" with ``Tensor.pin_memory`` and
``torch.cuda.current_stream`` faked (the copies themselves run on CPU tensors), and its file reads
and writes are logged, so the order of fences against buffer reuse is what is checked. The numbers
are those of the CPU path; on CPU nothing is pinned and nothing waits.
"""

from __future__ import annotations

import types

import torch

from megalite.core.optimizer.nvme_store import NvmeStore
from megalite.core.optimizer.sharded_state import DiskPiece, adam_on_disk


def _faked(monkeypatch, store_device: str, tmp_path):
    log: list[str] = []
    pinned: list[int] = []

    def pin_memory(self):
        pinned.append(self.numel())
        return self

    def current_stream(device=None):
        assert torch.device(device).type == "cuda", device
        return types.SimpleNamespace(synchronize=lambda: log.append("sync"))

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    store = NvmeStore(str(tmp_path), "r0", 10, host_bytes=24 * 4, device=store_device)
    read, write = store._read, store._write
    monkeypatch.setattr(store, "_read", lambda k, lo, v: (log.append(f"read {k}"), read(k, lo, v)))
    monkeypatch.setattr(
        store, "_write", lambda k, lo, v: (log.append(f"write {k}"), write(k, lo, v))
    )
    return store, log, pinned


def _round_trip(store):
    """Masters staged and saved, then one optimizer-like pass: load with the grad, update,
    save, copy the masters out; returns what the files hold."""
    values = torch.arange(10.0)
    for a, b in store.chunks(0, 10):
        store.stage("master", values[a:b] * 2)
        store.save(a, b, keys=("master",))
    for a, b in store.chunks(0, 10):
        master, exp_avg, exp_avg_sq, grad = store.load(a, b, grads=[(0, values[a:b] + 100)])
        assert torch.equal(grad, values[a:b] + 100)  # landed before the host reads it
        master.add_(grad)
        exp_avg.add_(1.0)
        store.save(a, b)
    return {k: store.read(k) for k in ("master", "exp_avg")}


def test_nvme_buffers_pinned_and_fenced_on_cuda(monkeypatch, tmp_path):
    store, log, pinned = _faked(monkeypatch, "cuda", tmp_path)
    assert store.pinned and pinned == [store.chunk] * 4  # master, moments, grad
    log.clear()
    master, *_ = store.load(0, 4, grads=[(0, torch.ones(4))])
    # the moments are read while the grad is in flight; the master buffer (which the previous
    # chunk's non-blocking copy into the params may still read) only after a fence
    assert log == ["read exp_avg", "read exp_avg_sq", "sync", "read master"], log
    log.clear()
    store.load(0, 4, keys=("master",))
    assert log == ["sync", "read master"], log
    log.clear()
    store.stage("master", torch.full((4,), 7.0))
    store.save(0, 4, keys=("master",))
    assert log[-2:] == ["sync", "write master"], log  # the staged copy lands before the write
    log.clear()
    store.load(0, 4, keys=("exp_avg",), grads=[(0, torch.ones(4))])
    assert log == ["read exp_avg", "sync"], log  # the grad lands before it is returned

    files = _round_trip(store)
    want = torch.arange(10.0) * 3 + 100
    assert torch.equal(files["master"], want) and torch.equal(files["exp_avg"], torch.ones(10))


def test_nvme_buffers_on_cpu_are_neither_pinned_nor_fenced(monkeypatch, tmp_path):
    store, log, pinned = _faked(monkeypatch, "cpu", tmp_path)
    monkeypatch.setattr(torch.cuda, "current_stream", _no_stream)
    assert not store.pinned and pinned == []
    files = _round_trip(store)
    assert "sync" not in log
    assert torch.equal(files["master"], torch.arange(10.0) * 3 + 100)


def _no_stream(device=None):
    raise AssertionError("a CPU store waited on a CUDA stream")


def test_adam_on_disk_stages_grads_through_the_pinned_buffer(monkeypatch, tmp_path):
    """``adam_on_disk`` on a pinned store (grads staged into its grad buffer, chunk by chunk, at
    each piece's offset) gives the files and params of the unpinned one (grads used in place);
    two pieces in two param groups, chunks of 4 that cut both."""
    group = torch.optim.AdamW([torch.zeros(1)], lr=0.1, weight_decay=0.5).param_groups[0]
    groups = [group, {**group, "weight_decay": 0.0}]
    grads = torch.linspace(-1.0, 1.0, 10)
    out = {}
    for device in ("cpu", "cuda"):
        store, log, _ = _faked(monkeypatch, device, tmp_path / device)
        params = torch.zeros(10)
        sb = types.SimpleNamespace(
            store=store,
            copy_to_params=lambda lo, m, params=params: params[lo : lo + m.numel()].copy_(m),
        )
        for a, b in store.chunks(0, 10):
            store.stage("master", torch.arange(a, b, dtype=torch.float32))
            store.save(a, b, keys=("master",))
        pieces = [DiskPiece(0, 3, 0, grads[:3].clone()), DiskPiece(3, 7, 1, grads[3:].clone())]
        for step in (1, 2):
            adam_on_disk(sb, pieces, groups, step=step)
        out[device] = (params, *(store.read(k) for k in ("master", "exp_avg", "exp_avg_sq")))
        assert store.pinned == (device == "cuda") and ("sync" in log) == store.pinned
    assert all(torch.equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
    assert torch.equal(out["cpu"][0], out["cpu"][1])  # the params are the rounded masters
    assert torch.allclose(out["cpu"][2], 0.19 * grads, rtol=1e-6, atol=0)  # exp_avg, 2 steps
