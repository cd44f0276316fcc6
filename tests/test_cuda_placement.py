"""The CUDA paths that can be checked without a GPU (docs/CUDA_AUDIT.md lists what cannot).

Each test drives the device- or backend-dependent branch with a fake: a device string or
``torch.device("meta")`` where the code only places tensors, a patched ``torch.cuda`` function
where it reads the allocator or synchronises, a patched ``dist.get_backend`` where it picks a
collective. No process group is created.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint import records
from megalite.core.context_parallel.comm import Ring
from megalite.core.distributed import shard_collectives
from megalite.core.optimizer.sharded_optimizer import ShardedOptimizer
from megalite.core.pipeline_parallel.actions import StageLayout
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.data import samplers
from megalite.training import progress


def test_rng_states_restored_only_on_the_device_kind_that_saved_them(monkeypatch, caplog):
    """A CPU generator state does not fit the CUDA generator (nor back): a checkpoint saved on
    CPU and resumed on CUDA keeps the CUDA and tracker generators' start-up seeding instead of
    failing at the first dropout; the CPU/Python/numpy states are restored either way."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: calls.append(a))
    cpu = torch.device("cpu")
    tracker = RNGStatesTracker(cpu)
    tracker.add("tensor-parallel", 5)
    torch.manual_seed(11)
    saved = records.capture_rng_state(tracker, cpu)  # saved on CPU: "cuda" is None
    expected_cpu = torch.rand(3)
    fresh = RNGStatesTracker(cpu)
    fresh.add("tensor-parallel", 99)
    before = fresh.get_states()["tensor-parallel"]

    records.restore_rng_state(saved, fresh, torch.device("cuda", 0))
    assert not calls
    assert torch.equal(fresh.get_states()["tensor-parallel"], before)  # not a CPU state
    assert torch.equal(torch.rand(3), expected_cpu)  # the CPU generator was restored
    assert "saved on cpu, restored on cuda" in caplog.text

    saved_gpu = dict(saved, cuda=torch.zeros(16, dtype=torch.uint8))  # as if saved on CUDA
    records.restore_rng_state(saved_gpu, fresh, torch.device("cuda", 0))
    assert len(calls) == 1 and calls[0][1] == torch.device("cuda", 0)
    assert torch.equal(fresh.get_states()["tensor-parallel"], saved["tracker"]["tensor-parallel"])

    fresh.set_states({"tensor-parallel": before})
    records.restore_rng_state(saved_gpu, fresh, cpu)  # CUDA states on a CPU run: not applied
    assert len(calls) == 1
    assert torch.equal(fresh.get_states()["tensor-parallel"], before)


def _FakeP2POp(op, tensor, peer, group=None, tag=0):  # noqa: N802  (no group registry needed)
    return types.SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag)


def _patch_group(monkeypatch, backend: str, size: int = 4, rank: int = 1) -> dict:
    """shard_collectives sees a group of ``size`` on ``backend``; returns the calls it makes."""
    seen: dict = {}
    monkeypatch.setattr(shard_collectives, "group_size", lambda g: size)
    monkeypatch.setattr(shard_collectives, "group_rank", lambda g: rank)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: r)
    monkeypatch.setattr(dist, "P2POp", _FakeP2POp)

    def record(name):
        def fn(*args, **kwargs):
            seen.setdefault(name, []).append((args, kwargs))
            return [] if name == "batch_isend_irecv" else types.SimpleNamespace(wait=lambda: None)

        return fn

    names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single")
    for name in (*names, "all_gather_into_tensor", "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, record(name), raising=False)
    return seen


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_shard_collectives_native_on_nccl_exchange_on_gloo(monkeypatch, backend):
    """nccl: the native reduce-scatter / all-gather, in place (output = this rank's shard of the
    input); gloo: the point-to-point exchange. Sync and async forms both."""
    seen = _patch_group(monkeypatch, backend)
    data = torch.arange(8.0)
    shard_collectives.reduce_scatter_shard(data, "g")
    shard_collectives.start_reduce_scatter_shard(data, "g")
    shard_collectives.all_gather_shard(data, "g")
    shard_collectives.all_gather_shard(data, "g", async_op=True)
    if backend == "gloo":
        assert set(seen) == {"batch_isend_irecv"}
        return
    assert "batch_isend_irecv" not in seen
    # every call goes through the torch name this version has (core.groups picks it)
    rs = seen.get("reduce_scatter_single") or seen["reduce_scatter_tensor"]
    ag = seen.get("all_gather_single") or seen["all_gather_into_tensor"]
    for (out, inp, *_), _ in rs:  # out: shard 1 of data, in place
        assert inp is data and out.data_ptr() == data[2:4].data_ptr() and out.numel() == 2
    for (out, inp, *_), _ in ag:
        assert out is data and inp.data_ptr() == data[2:4].data_ptr() and inp.numel() == 2
    # the sync form, then the async one, of each
    assert [kw["async_op"] for _, kw in rs] == [False, True]
    assert [kw["async_op"] for _, kw in ag] == [False, True]


def test_cp_ring_exchange_is_one_p2p_batch(monkeypatch):
    """nccl ignores tags and runs a lone send and a lone recv between a pair in posting order
    (the send would wait for a recv queued behind it): the ring posts both as one batch."""
    batches = []
    monkeypatch.setattr(dist, "P2POp", _FakeP2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: batches.append(ops) or ["w"])
    for name in ("isend", "irecv"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("a lone isend/irecv"))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: 10 + rank)
    ring = Ring.__new__(Ring)
    ring.group, ring.stats, ring.size, ring.rank = "g", None, 4, 0
    send, recv = torch.ones(3), torch.empty(3)
    assert ring.exchange(send, recv, tag=7).works == ["w"]
    assert ring.exchange(send, recv, tag=8, distance=3).works == ["w"]  # a jump over skipped steps
    assert [[(op.op, op.tensor, op.peer, op.tag) for op in ops] for ops in batches] == [
        [(dist.isend, send, 11, 7), (dist.irecv, recv, 13, 7)],
        [(dist.isend, send, 13, 8), (dist.irecv, recv, 11, 8)],
    ]


def test_offloaded_grads_reach_the_host_before_the_host_step(monkeypatch):
    """ZeRO offload: the grads of host-resident pieces go device -> host with non_blocking (into
    pinned memory); the host optimizer reads them right after, so on CUDA the step waits for the
    copies once (a device-resident-only step does not)."""
    synced = []
    stream = types.SimpleNamespace(synchronize=lambda: synced.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)

    def opt(*wheres: str):
        pieces = [
            types.SimpleNamespace(where=w, master=torch.nn.Parameter(torch.zeros(2)))
            for w in wheres
        ]
        grads = [torch.full((2,), float(i + 1)) for i in range(len(wheres))]
        return types.SimpleNamespace(
            pieces=pieces, _piece_grads=grads, _device=torch.device("cuda")
        )

    o = opt("host", "device", "host")
    ShardedOptimizer._before_inner_step(o)
    assert synced == [1]
    # the host step reads the copies from ``_host_grads`` (the inner optimizer sees no .grad)
    assert o._host_grads[id(o.pieces[0])].tolist() == [1.0, 1.0]
    assert id(o.pieces[1]) not in o._host_grads and o.pieces[0].master.grad is None
    ShardedOptimizer._before_inner_step(opt("device"))
    assert synced == [1]


def test_pipeline_loss_handover_on_the_p2p_device_names_once(monkeypatch):
    """A V layout computes the loss on pipeline rank 0 and hands it to the last rank: every
    tensor sent or received lives on the p2p device (nccl moves no CPU tensor), and the loss
    names (a host read) travel in the first step only."""
    sent, objects = [], []
    monkeypatch.setattr(dist, "send", lambda t, *a, **k: sent.append(t))
    monkeypatch.setattr(dist, "send_object_list", lambda names, *a, **k: objects.append(names))

    def comm():
        return P2PCommunicator(
            prev_rank=None,
            next_rank=None,
            tensor_shape=(1,),
            dtype=torch.float32,
            device=torch.device("meta"),
            group=None,
            pp_ranks=[0, 1],
        )

    layout = StageLayout(pp_size=2, num_chunks=2, shape="v")
    assert layout.loss_rank() == 0
    losses = [{"lm loss": torch.tensor(1.0)}, {"lm loss": torch.tensor(2.0)}]
    p2p = comm()
    for _ in range(3):
        assert p2p.losses_to_last_rank(losses, layout, 0, 2) == []
    assert objects == [["lm loss"]]
    assert [tuple(t.shape) for t in sent] == [(1,), (2, 1), (2, 1), (2, 1)]  # header once
    assert {t.device.type for t in sent} == {"meta"}
    with pytest.raises(RuntimeError, match="keep the names fixed"):
        p2p.losses_to_last_rank([{"other": torch.tensor(1.0)}], layout, 0, 1)

    received = []

    def recv(t, *a, **k):
        received.append(t)
        if t.dtype == torch.int64:
            raise StopIteration  # a meta header cannot be read: its placement is what matters

    monkeypatch.setattr(dist, "recv", recv)
    with pytest.raises(StopIteration):
        comm().losses_to_last_rank([], layout, 1, 2)
    assert received[-1].device.type == "meta"
    last = comm()
    last.loss_names = ["lm loss"]  # a later step: only the values are received
    out = last.losses_to_last_rank([], layout, 1, 2)
    assert received[-1].shape == (2, 1) and received[-1].device.type == "meta"
    assert [list(d) for d in out] == [["lm loss"], ["lm loss"]]


def test_peak_memory_is_the_cuda_allocators_on_cuda(monkeypatch):
    asked = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda d=None: asked.append(d) or 3 * 2**20
    )
    assert progress.peak_memory_mib(torch.device("cuda", 1)) == 3.0
    assert asked == [torch.device("cuda", 1)]
    assert progress.peak_memory_mib(torch.device("cpu")) > 0  # the resident set on CPU
    assert len(asked) == 1


@pytest.mark.parametrize("device, pinned", [("cuda", True), ("cpu", False), (None, False)])
def test_loader_pins_host_memory_only_for_a_cuda_run(monkeypatch, device, pinned):
    seen = {}

    class FakeLoader:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def __iter__(self):
            return iter(())

    monkeypatch.setattr(torch.utils.data, "DataLoader", FakeLoader)
    samplers.make_loader([], None, eod=0, eod_mask_loss=False, device=device)
    assert seen["pin_memory"] is pinned
