"""Checkpoints that must be refused, and the flags around saving and loading (one process).

Refused with a one-line ``CheckpointError`` that names what differs: a checkpoint of another model
shape (the flag and both values), a truncated shard file (its path), a checkpoint with a missing
shard (incomplete save), a garbled tracker, optimizer state asked for but not saved. And the
behaviours: no tracker yet means training from scratch; ``--finetune`` takes the weights only;
``--keep-last-n-checkpoints``; ``--exit-interval`` and ``--exit-duration-in-mins`` save before
exiting; flags that need ``--save`` / ``--load`` are refused at parse time.
"""

from __future__ import annotations

import os

import pytest
import torch

from megalite.checkpoint.files import CheckpointError, read_tracker, saved_iterations
from megalite.conversion.megalite_files import write_checkpoint
from megalite.core.parallel_state import ParallelState
from megalite.inference import load_model
from megalite.training.checkpoint_io import load_checkpoint
from megalite.training.config import ConfigError
from tests.models.helpers import make_config
from tests.training.common import FAMILIES, config, train_losses, trainer_and_data

SINGLE = ParallelState.single()


def _train(*flags: str):
    cfg = config(*flags)
    return train_losses(cfg, SINGLE)


def _loader(*flags: str):
    trainer, _ = trainer_and_data(config(*flags), SINGLE)
    return trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A GPT-2 checkpoint (h = 32) of iterations 2 and 4."""
    path = str(tmp_path_factory.mktemp("ckpt"))
    _train("--train-iters", "4", "--save", path, "--save-interval", "2")
    return path


def test_another_model_shape_is_refused_naming_the_setting(saved):
    for flags, named in (
        (["--hidden-size", "64"], "--hidden-size is 32 in the checkpoint but 64 in this run"),
        (["--num-layers", "3"], "--num-layers is 2 in the checkpoint but 3"),
        (["--vocab-size", "255"], "--vocab-size (the tokenizer's vocabulary) is 128"),
        (FAMILIES["llama"], "--position-embedding-type is learned_absolute in the checkpoint"),
    ):
        trainer = _loader(*flags, "--load", saved)
        with pytest.raises(CheckpointError, match=r"another shape") as e:
            load_checkpoint(trainer)
        assert named in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_truncated_missing_and_garbled_files_are_refused(saved, tmp_path):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(saved, copy)
    shard = os.path.join(copy, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        load_checkpoint(_loader("--load", copy))
    assert shard in str(e.value) and "--ckpt-step" in str(e.value)
    trainer = _loader("--load", copy, "--ckpt-step", "2")  # the earlier one still loads
    assert load_checkpoint(trainer) is not None and trainer.result.iteration == 2

    cfg = make_config("gpt2")
    state = load_model(saved).state_dict()
    two = str(tmp_path / "tp2")
    write_checkpoint(state, cfg, two, tp_size=2, iteration=4)
    shutil.rmtree(os.path.join(two, "iter_0000004", "mp_rank_01"))
    with pytest.raises(CheckpointError, match="incomplete"):
        load_model(two)

    with open(os.path.join(copy, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("four\n")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        read_tracker(copy)


def test_no_tracker_trains_from_scratch_and_no_save_optim_needs_no_load_optim(tmp_path):
    assert load_checkpoint(_loader("--load", str(tmp_path))) is None
    path = str(tmp_path / "weights")
    _train("--train-iters", "2", "--save", path, "--no-save-optim")
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        load_checkpoint(_loader("--load", path))
    trainer = _loader("--load", path, "--no-load-optim")
    assert load_checkpoint(trainer) is not None and trainer.result.iteration == 2


def test_finetune_takes_the_weights_only(saved):
    trainer = _loader("--load", saved, "--finetune")
    loaded = load_checkpoint(trainer)
    assert loaded.rng_state is None and trainer.result.iteration == 0
    assert trainer.result.consumed_train_samples == 0
    want = load_model(saved).state_dict()
    got = trainer.model[0].module.state_dict()
    for name, value in want.items():
        ours = got[name][: value.shape[0]] if name.endswith("word_embeddings.weight") else got[name]
        assert torch.equal(ours, value), name
    assert trainer.optimizer.full_state_dict()["step"] == 0


def test_keep_last_n_and_exit_flags_save_before_exiting(tmp_path):
    keep = str(tmp_path / "keep")
    _train(
        "--train-iters",
        "4",
        "--save",
        keep,
        *"--save-interval 1 --keep-last-n-checkpoints 2".split(),
    )
    assert saved_iterations(keep) == [3, 4] and read_tracker(keep) == 4

    exit_at = str(tmp_path / "exit")
    result = _train(
        "--train-iters", "5", "--save", exit_at, "--save-interval", "2", "--exit-interval", "3"
    )
    assert result.iteration == 3 and saved_iterations(exit_at) == [2, 3]
    assert read_tracker(exit_at) == 3

    timed = str(tmp_path / "timed")
    result = _train("--train-iters", "5", "--save", timed, "--exit-duration-in-mins", "1e-9")
    assert result.iteration == 1 and read_tracker(timed) == 1


def test_flags_that_need_save_or_load_are_refused():
    for flags, named in (
        (["--save-interval", "10"], "--save-interval 10 needs --save"),
        (["--finetune"], "--finetune needs --load"),
        (["--save", "x", "--save-interval", "0"], "--save-interval must be >= 1"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
    ):
        with pytest.raises(ConfigError, match=named):
            config(*flags)
