"""``--async-save``: the files a synchronous save writes, written while training goes on.

Each case trains the tiny model 4 iterations (of 6) saving every 2, once with ``--async-save``
and once with the same config but no background writer (``trainer.async_writer = None``: the
synchronous path), into the same folder name (the run's config, recorded in the header, names
it), and compares the files entry by entry of their zip archives: equal bytes, except the random
``.data/serialization_id`` torch writes in every file. The host copy of each save starts only
once the loop has run the next step's forward and backward and waits at its optimizer step (a
hook in the copy waits for that, or for the step's end when the step does not wait: then the
update's weights would be saved), and the save of iteration 2 is written only once the loop has
finished iteration 3, so a host copy that were not a snapshot would hold iteration 3's weights;
the snapshot of iteration 4 lies in the host memory of iteration 2's (the second save allocates
none). A resume from the async checkpoint repeats the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import inspect
import os
import random
import shutil
import sys
import threading
import time
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint import async_save, read_tracker
from megalite.checkpoint.async_save import (
    WRITER_NICE,
    AsyncCheckpointWriter,
    HostBuffer,
    HostSnapshot,
    host_copy,
    plan_host_copy,
    tensors_in,
)
from megalite.checkpoint.saving import non_finite_beside_training
from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import config, trainer_and_data

# 6 iterations planned (the LR schedule), 4 run
FLAGS = ("--save-interval", "2", "--train-iters", "6", "--exit-interval", "4", "--async-save")


def archive(path: str) -> dict[str, bytes]:
    """The entries of a ``torch.save`` zip file but its random serialization id."""
    with zipfile.ZipFile(path) as z:
        return {
            n.split("/", 1)[1]: z.read(n)
            for n in z.namelist()
            if not n.endswith(".data/serialization_id")
        }


def same_files(a: str, b: str) -> list[str]:
    """The relative paths of the files under ``a``, having checked ``b`` holds the same ones with
    the same content (``.pt``: the same archive entries)."""
    names = sorted(os.path.relpath(os.path.join(r, f), a) for r, _, fs in os.walk(a) for f in fs)
    other = sorted(os.path.relpath(os.path.join(r, f), b) for r, _, fs in os.walk(b) for f in fs)
    assert names == other
    for name in names:
        x, y = os.path.join(a, name), os.path.join(b, name)
        if name.endswith(".pt"):
            assert archive(x) == archive(y), name
        else:
            assert open(x, "rb").read() == open(y, "rb").read(), name
    return names


def writer_waiting_for_the_loop(
    trainer, seen: list, places: list | None = None, timeout: float = 60.0
):
    """A ``write_pending`` that writes iteration 2's save only once ``trainer`` has finished
    iteration 3 (or ``timeout`` passed: a save that blocks the loop); ``seen`` gets (iteration
    saved, iteration the loop had reached, the writing thread's nice value) of each write,
    ``places`` the addresses of the host storages each snapshot lies in."""
    write = async_save.write_pending

    def write_later(pending):
        if places is not None:
            storages = (t.untyped_storage() for t in async_save.tensors_in(pending.writes))
            places.append(sorted({s.data_ptr() for s in storages if s.nbytes()}))
        deadline, reached = time.monotonic() + timeout, trainer.result.iteration
        while pending.iteration == 2 and reached < 3:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
            reached = trainer.result.iteration
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen.append((pending.iteration, reached, nice))
        return write(pending)

    return write_later


def copy_after_the_next_backward(trainer, monkeypatch, released: list, timeout: float = 60.0):
    """Every host copy of ``trainer``'s saves starts only when the loop waits for it (at the
    next optimizer step, after that step's forward and backward; or at ``finish``), or once the
    loop finished the next step without waiting (a bug: then the update's weights are copied);
    ``released`` gets, per copy, ``"waited for"`` or ``"not waited for"``."""
    asked = threading.Event()
    wait, finish, copy = (
        AsyncCheckpointWriter.wait_for_copy,
        AsyncCheckpointWriter.finish,
        HostSnapshot.copy,
    )

    def wait_and_ask(self):
        if self.copying:
            asked.set()
        return wait(self)

    def finish_and_ask(self):
        if self.in_flight is not None:
            asked.set()
        return finish(self)

    def copy_when_asked(self, *, non_blocking):
        iteration, deadline = trainer.result.iteration, time.monotonic() + timeout
        while not asked.is_set() and trainer.result.iteration == iteration:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        released.append("waited for" if asked.is_set() else "not waited for")
        asked.clear()
        return copy(self, non_blocking=non_blocking)

    monkeypatch.setattr(AsyncCheckpointWriter, "wait_for_copy", wait_and_ask)
    monkeypatch.setattr(AsyncCheckpointWriter, "finish", finish_and_ask)
    monkeypatch.setattr(HostSnapshot, "copy", copy_when_asked)


def train(
    cfg,
    ps,
    *,
    background: bool,
    seen: list | None = None,
    places=None,
    released: list | None = None,
    monkeypatch=None,
) -> list:
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(0)  # the Python and numpy RNG states are saved too: the same in both runs
    trainer, data = trainer_and_data(cfg, ps)
    if not background:
        trainer.async_writer = None
    elif monkeypatch is not None:
        if seen is not None:
            hook = writer_waiting_for_the_loop(trainer, seen, places)
            monkeypatch.setattr(async_save, "write_pending", hook)
        copy_after_the_next_backward(trainer, monkeypatch, [] if released is None else released)
    return trainer.train(make_forward_step(torch.device("cpu")), data).losses


def test_host_copy_is_a_snapshot_that_keeps_storage_sharing():
    flat = torch.arange(10.0)
    state = {"a": flat[:4], "b": flat[4:].view(2, 3), "tied": flat[:4], "n": 3, "t": (flat[9:],)}
    state["e"] = [torch.empty(0), torch.empty(0, dtype=torch.int64)]
    copy, copied = host_copy(state, buffer=HostBuffer(pin=False))
    assert copied == flat.numel() * flat.element_size()  # one storage, copied once
    flat.add_(100.0)  # the live state moves on
    assert torch.equal(copy["a"], torch.arange(4.0)) and copy["n"] == 3
    assert torch.equal(copy["b"], torch.arange(4.0, 10.0).view(2, 3))
    assert copy["b"].untyped_storage().data_ptr() == copy["a"].untyped_storage().data_ptr()
    assert copy["b"].storage_offset() == 4 and copy["tied"] is not copy["a"]
    assert copy["t"][0].item() == 9.0
    assert [e.dtype for e in copy["e"]] == [torch.float32, torch.int64]
    assert copy["e"][0].untyped_storage() is not copy["e"][1].untyped_storage()


def test_every_snapshot_is_copied_into_the_host_memory_of_the_first():
    """One buffer made once, as large as the snapshot (each storage rounded up to 64 bytes):
    a second snapshot, even of tensors made anew (as the RNG states are at each save), lies
    where the first did; only a larger one replaces it."""
    buffer = HostBuffer(pin=False)

    def state(n: int) -> dict:
        return {"w": torch.full((n,), float(n)), "rng": torch.arange(3), "b": torch.ones(5)}

    places = []
    for n in (100, 100, 300):
        copy, copied = host_copy(state(n), buffer=buffer)
        places.append([t.untyped_storage().data_ptr() for t in copy.values()])
        assert copied <= buffer.nbytes < copied + 64 * 3 and torch.equal(copy["w"], state(n)["w"])
        assert buffer.allocations == (1 if n == 100 else 2)
    assert places[1] == places[0] != places[2]


def beside_a_thread(work, look) -> list:
    """Run ``work`` in a thread while this one calls ``look()`` each time it holds the GIL, until
    the thread is done; returns what ``look`` saw. The switch interval is an hour: a thread
    gives the GIL up only where a call releases it (or waits), so ``look`` sees the thread only
    inside calls that release the GIL."""
    done, seen = threading.Event(), []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(3600.0)
    try:
        thread = threading.Thread(target=lambda: (work(), done.set()))
        thread.start()
        while not done.is_set():
            seen.append(look(thread))
            done.wait(0.0005)  # lets the GIL go
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    return seen


def test_the_writers_copy_lets_the_loops_python_run_while_it_copies():
    """The copy runs beside the next step's forward and backward, whose Python needs the GIL:
    each storage's copy must release it (``UntypedStorage.copy_`` holds it for the whole copy,
    and the step stood still). The main thread, looking at the host copy whenever it holds the
    GIL, sees a storage copied in part only if a copy let the GIL go while it was copying."""
    state = {f"w{i}": torch.ones(1 << 23) for i in range(4)}  # 4 x 32 MB
    snapshot = plan_host_copy(state, buffer=HostBuffer(pin=False))
    for t in tensors_in(snapshot.obj):
        t.zero_()
    places = torch.linspace(0, (1 << 23) - 1, 1024).long()

    def copied_in_part(_thread) -> bool:
        ones = [int(t[places].sum()) for t in tensors_in(snapshot.obj)]
        return any(0 < n < len(places) for n in ones)

    assert any(beside_a_thread(lambda: snapshot.copy(non_blocking=False), copied_in_part))
    assert all(torch.equal(t, torch.ones(1 << 23)) for t in tensors_in(snapshot.obj))


def test_the_writers_check_lets_the_loops_python_run_while_it_reads():
    """The NaN/inf check runs beside the step too: the main thread, whenever it holds the GIL,
    sees where the thread is; it must see it inside a reduction (a check holding the GIL while
    it reads would be seen only between its calls)."""
    named = [(f"w{i}", torch.ones(1 << 23)) for i in range(4)]
    lines, first = inspect.getsourcelines(non_finite_beside_training)
    reading = {first + i for i, line in enumerate(lines) if "values.min()" in line}
    assert len(reading) == 1

    def line_of_the_check(thread) -> int | None:
        frame = sys._current_frames()[thread.ident]  # the innermost: numpy's or torch's
        while frame is not None and frame.f_code is not non_finite_beside_training.__code__:
            frame = frame.f_back
        return None if frame is None else frame.f_lineno

    seen = beside_a_thread(lambda: non_finite_beside_training(named), line_of_the_check)
    assert reading & set(seen), (reading, seen)


def test_async_save_writes_the_sync_files_while_training_goes_on(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    cfg = config("--save", str(save), *FLAGS)
    seen, places, released = [], [], []
    async_losses = train(
        cfg,
        ParallelState.single(),
        background=True,
        seen=seen,
        places=places,
        released=released,
        monkeypatch=monkeypatch,
    )
    # iteration 2 was written after the loop's iteration 3 (or 4, the writer being slow to
    # wake), iteration 4's at the end; the writer yields the step its cores
    assert [(i, nice) for i, _, nice in seen] == [(2, WRITER_NICE), (4, WRITER_NICE)]
    assert seen[0][1] in (3, 4) and seen[1][1] == 4
    # the save of iteration 4 was copied into the host memory of iteration 2's: no allocation
    assert len(places[0]) > 10 and places[1] == places[0]
    assert read_tracker(str(save)) == 4
    shutil.move(save, tmp_path / "async")
    monkeypatch.undo()
    sync_losses = train(cfg, ParallelState.single(), background=False)
    assert async_losses == sync_losses
    # iteration 2 copied after iteration 3's forward and backward: still iteration 2's state
    names = same_files(str(save), str(tmp_path / "async"))
    assert "iter_0000002/mp_rank_00/model_optim_rng.pt" in names
    assert released == ["waited for", "waited for"]  # at iteration 3's update; at the end

    resumed = pretrain(config("--load", str(tmp_path / "async"), "--train-iters", "6"), env={})
    straight = pretrain(config("--train-iters", "6"), env={})
    assert resumed.losses == straight.losses[4:]


def test_async_save_under_zero3_copies_the_gathered_params_before_they_are_released(
    tmp_path, monkeypatch
):
    """ZeRO-3 releases the whole parameters when the save returns: the save waits for its copy
    (one process: the shards are whole, the release is the same)."""
    save = tmp_path / "ckpt"
    cfg = config("--save", str(save), *FLAGS, "--zero-stage", "3")
    released = []
    losses = train(
        cfg, ParallelState.single(), background=True, released=released, monkeypatch=monkeypatch
    )
    shutil.move(save, tmp_path / "async")
    monkeypatch.undo()
    assert train(cfg, ParallelState.single(), background=False) == losses
    assert "iter_0000004/mp_rank_00/model_optim_rng.pt" in same_files(
        str(save), str(tmp_path / "async")
    )
    assert released == ["waited for", "waited for"]  # by the save call itself


def _two_ranks_zero1(save: str) -> list[str]:
    """DP 2 with the distributed optimizer: every rank writes its distrib_optim file."""
    rank = dist.get_rank()
    ps = mesh(1, 1)
    cfg = config("--save", save, *FLAGS, "--use-distributed-optimizer", world_size=2, rank=rank)
    losses = train(cfg, ps, background=True)
    if rank == 0:
        shutil.move(save, save + "-async")
    dist.barrier()
    assert train(cfg, ps, background=False) == losses
    dist.barrier()
    return same_files(save, save + "-async") if rank == 0 else []


@pytest.mark.slow
def test_async_save_under_zero1_writes_every_ranks_sync_files(tmp_path):
    names = run_distributed(_two_ranks_zero1, 2, str(tmp_path / "ckpt"))[0]
    assert "iter_0000004/mp_rank_00/distrib_optim_001.pt" in names
