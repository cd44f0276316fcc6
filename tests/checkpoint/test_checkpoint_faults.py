"""Faults at a save: a full disk (or a folder turning read-only) part-way through a checkpoint, a
``--save`` folder that cannot be written, fp16 weights that became non-finite. Each ends the run
with one ``error:`` line naming the iteration and the folder; no temporary file stays; the tracker
still names the previous checkpoint, which loads.

The full disk is simulated without root tricks: ``open`` as seen by ``megalite.checkpoint.files``
returns a file whose writes raise ``OSError(ENOSPC)`` after a few bytes (for the paths of one
iteration, or the tracker), as a full file system does part-way through ``torch.save``.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil

import pytest
import torch

from megalite.checkpoint import files
from megalite.checkpoint.saving import (
    checked_parameters,
    non_finite_beside_training,
    non_finite_parameters,
)
from megalite.inference import load_model
from pretrain_gpt import main
from tests.user_errors import TINY, files_under, one_error_line, read_only, run_in_process

RUN = [*TINY, "--mock-data", "--save-interval", "2"]


class _FullDisk:
    """A file whose writes fail with ``err`` once ``limit`` bytes are written."""

    def __init__(self, f, limit: int, err: int):
        self._f, self._left, self._err = f, limit, err

    def write(self, data):
        if len(data) > self._left:
            raise OSError(self._err, "simulated")
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _failing_open(marker: str, err: int):
    """Writes to paths containing ``marker`` fail (the tracker: once iteration 4 is written)."""

    def fake_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        if marker in str(path) and "w" in mode:
            if not marker.startswith("latest"):
                return _FullDisk(f, 4096, err)
            if os.path.isdir(os.path.join(os.path.dirname(str(path)), "iter_0000004")):
                return _FullDisk(f, 0, err)
        return f

    return fake_open


@pytest.mark.parametrize(
    "marker, err, reason",
    [
        ("iter_0000004", errno.ENOSPC, "no space left on the device"),
        ("iter_0000004", errno.EROFS, "read-only file system"),
        ("latest_checkpointed_iteration.txt", errno.ENOSPC, "no space left on the device"),
    ],
)
def test_a_failed_save_stops_with_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, capsys, monkeypatch, marker, err, reason
):
    save = tmp_path / "ckpt"
    monkeypatch.setattr(files, "open", _failing_open(marker, err), raising=False)
    status, out = run_in_process(main, [*RUN, "--save", save], capsys)
    assert status == 1
    line = one_error_line(
        out,
        "iteration 4",
        str(save),
        reason,
        "latest checkpoint stays iteration 2",
        "training stops",
    )
    if marker.startswith("iter"):
        assert "MB are free" in line and "it needs about" in line
    left = files_under(save)
    assert not [f for f in left if f.endswith(".tmp")], left
    assert not [f for f in left if f.startswith("iter_0000004")], left
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    monkeypatch.undo()
    model = load_model(str(save))
    assert model.checkpoint_info["iteration"] == 2


def test_an_unwritable_save_folder_is_refused_before_training(tmp_path, capsys):
    save = tmp_path / "ckpt"
    with read_only(save) as ok:
        if not ok:
            pytest.skip("no way to make a folder read-only here (chattr)")
        status, out = run_in_process(main, [*RUN, "--save", save], capsys)
    assert status == 1
    one_error_line(out, f"--save {save}", "cannot write in this folder")
    assert files_under(save) == []


def test_non_finite_weights_never_become_the_latest_checkpoint(tmp_path, capsys):
    save = tmp_path / "ckpt"
    fp16 = ["--fp16", "--initial-loss-scale", "1", "--save", save]
    assert main([str(a) for a in [*RUN, *fp16, "--train-iters", "2"]]) == 0
    # an absurd learning rate: the fp16 weights overflow to inf at the next step
    again = [*RUN, *fp16, "--load", save, "--no-load-optim", "--lr", "1e6"]
    status, out = run_in_process(main, again, capsys)
    assert status == 1
    one_error_line(
        out,
        "iteration 4: refusing to save",
        str(save),
        "not finite",
        "latest checkpoint stays iteration 2",
    )
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not [f for f in files_under(save) if f.startswith("iter_0000004") or ".tmp" in f]
    model = load_model(str(save))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _refused_save(save, *flags: str) -> str:
    """Save iteration 1, set a parameter to inf, save iteration 2: the refusal's message (with
    ``--async-save`` raised when the save of iteration 2 is finished, as at the next save)."""
    from megalite.core.parallel_state import ParallelState
    from megalite.training import checkpoint_io
    from tests.training.common import config, trainer_and_data

    cfg = config("--fp16", "--save", str(save), *flags)
    trainer, _ = trainer_and_data(cfg, ParallelState.single())
    trainer.result.iteration = 1
    checkpoint_io.save_checkpoint(trainer)
    checkpoint_io.wait_for_async_copy(trainer)  # as the optimizer step does before it updates
    module = trainer.model[0].module
    name, param = next(iter(module.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("inf")
    trainer.result.iteration = 2
    with pytest.raises(files.CheckpointError) as e:
        checkpoint_io.save_checkpoint(trainer)
        checkpoint_io.finish_async_save(trainer)
    message = str(e.value)
    assert (
        "\n" not in message and name in message and "latest checkpoint stays iteration 1" in message
    )
    assert files_under(save) == [
        "iter_0000001/mp_rank_00/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    ]
    return message


def test_save_checkpoint_refuses_non_finite_parameters(tmp_path):
    """The refusal itself, whatever stopped the loop first: a parameter set to inf. An
    asynchronous save (its check runs in the writer thread) refuses with the same message and
    leaves no file of the iteration either."""
    message = _refused_save(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt")
    assert _refused_save(tmp_path / "ckpt", "--async-save") == message


def test_every_non_finite_value_is_found_in_any_float_dtype():
    """NaN, +inf and -inf anywhere in a parameter, in fp32, fp16, bf16 and fp64; the largest
    finite value is finite; an empty parameter and an integer buffer are skipped. The async
    writer's check (numpy's reductions where numpy has the dtype) finds the same."""
    module = torch.nn.Module()
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for i, dtype in enumerate(dtypes):
        for bad in ("nan", "inf", "-inf", "ok"):
            data = torch.full((4, 5), 2.0, dtype=dtype)
            data[i, i + 1] = float(bad) if bad != "ok" else torch.finfo(dtype).max
            name = f"{dtype}_{bad}".replace("torch.", "").replace("-", "minus_")
            module.register_parameter(name, torch.nn.Parameter(data))
    module.register_parameter("empty", torch.nn.Parameter(torch.empty(0)))
    module.register_buffer("count", torch.tensor([7]))
    expected = [n for n, _ in module.named_parameters() if not n.endswith("ok") and n != "empty"]
    assert non_finite_parameters(module) == expected and len(expected) == 12
    named = checked_parameters([module, module])  # two chunks: the same names twice
    assert non_finite_beside_training(named) == expected * 2


def _two_rank_full_disk_case(save: str) -> str:
    """Rank 1's own ZeRO-1 shard of iteration 4 hits a full disk; every rank must stop (no hang)
    with one line, rank 0 having removed the partial iteration."""
    import torch.distributed as dist

    from megalite.training.pretrain import pretrain
    from tests.training.common import config

    rank = dist.get_rank()
    saved = files.open if hasattr(files, "open") else None
    if rank == 1:
        files.open = _failing_open("iter_0000004/mp_rank_00/distrib_optim_001.pt", errno.ENOSPC)
    try:
        cfg = config(
            "--use-distributed-optimizer",
            "--save",
            save,
            *"--save-interval 2 --train-iters 4".split(),
            world_size=2,
            rank=rank,
        )
        pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": "2"})
    except files.CheckpointError as e:
        return str(e)
    finally:
        if saved is None and hasattr(files, "open"):
            del files.open
    return "no error"


def test_a_save_failing_on_one_rank_stops_every_rank(tmp_path):
    from tests.harness import run_distributed

    save = tmp_path / "ckpt"
    messages = run_distributed(_two_rank_full_disk_case, 2, str(save))
    assert "no space left on the device" in messages[1] and "distrib_optim_001.pt" in messages[1]
    assert "a write failed on another rank" in messages[0]
    for m in messages:
        assert "\n" not in m and "iteration 4" in m and "stays iteration 2" in m
    left = files_under(save)
    assert not [f for f in left if f.endswith(".tmp") or f.startswith("iter_0000004")], left
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
