"""A finished in-process run leaves nothing behind: once ``pretrain`` returns and the garbage is
collected, its model chunks (with their data-parallel wrappers, grad buffers and the process groups
they hold) and its optimizer are gone. The parameters' grad hooks live in C++, out of sight of
Python's GC: while the hooks stay, a cycle through them is never freed, and every
run in a process (a test suite, a notebook) kept its model and its gloo groups, each group with a
thread of its own."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from megalite.training.pretrain import pretrain
from megalite.training.trainer import FirstStepHook
from tests.training.common import config


class _WatchRefs(FirstStepHook):
    """Weak references to the trainer's model chunks, their modules and its optimizer."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, weakref.ref]] = []

    def after_first_update(self, trainer) -> None:
        for i, chunk in enumerate(trainer.model):
            self.refs.append((f"model chunk {i} ({type(chunk).__name__})", weakref.ref(chunk)))
            self.refs.append((f"module of chunk {i}", weakref.ref(chunk.module)))
        self.refs.append(("optimizer", weakref.ref(trainer.optimizer)))


def _gloo_loop_threads() -> int:
    """This process's gloo connection loops: one thread per live gloo process group (Linux)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--zero-stage", "2"],
        ["--zero-stage", "3"],
        ["--bf16", "--use-distributed-optimizer"],
    ],
    ids=["ddp", "zero2", "zero3", "bf16 zero1"],
)
def test_a_finished_run_frees_its_model_and_optimizer(flags):
    gc.collect()
    loops = _gloo_loop_threads()
    watch = _WatchRefs()
    result = pretrain(config("--train-iters", "2", *flags), env={}, first_step_hooks=[watch])
    assert result.iteration == 2 and watch.refs
    del result
    gc.collect()
    alive = [name for name, ref in watch.refs if ref() is not None]
    assert not alive, f"still alive after the run returned and gc ran: {alive}"
    assert _gloo_loop_threads() == loops, "the run's gloo groups (their threads) outlived it"
