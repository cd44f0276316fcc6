"""What a Megatron checkpoint's ``args`` and scheduler fix when megalite loads it.

1. The model settings megalite implements beyond the shapes (``--add-qkv-bias``,
   ``--qk-layernorm``, ``--apply-layernorm-1p``, ``--squared-relu``, ``--rotary-percent``, ...)
   are read from ``args``: a run whose flags contradict them is refused in one line naming the
   flag, before any tensor is loaded; a model megalite does not build (``--multi-latent-attention``
   ...) is refused likewise.
2. The LR scheduler's position is Megatron's ``num_steps`` in SAMPLES: under
   ``--rampup-batch-size`` (iteration 2 after batches of 2 and 4: 6 samples) the position is
   6 / 4 = 1.5 final-size batches, and the rate is Megatron's at 6 samples, not at iteration 2.
"""

from __future__ import annotations

import argparse
import os

import pytest

from megalite.checkpoint import megatron
from megalite.checkpoint.files import CheckpointError
from megalite.core.parallel_state import ParallelState
from megalite.models.config import GPTConfig
from megalite.training import checkpoint_io
from megalite.training.arguments import parse_args
from megalite.training.config import with_tokenizer
from tests.checkpoint.megatron.test_formats import FIXTURES, FORMATS, MODEL
from tests.training.common import BASE, config, trainer_and_data

LEGACY = os.path.join(FIXTURES, FORMATS["torch"])


def _load(*extra: str):
    trainer, _ = trainer_and_data(config(*MODEL, "--load", LEGACY, *extra), ParallelState.single())
    return trainer, checkpoint_io.load_checkpoint(trainer)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--add-qkv-bias"], "--add-qkv-bias"),
        (["--qk-layernorm"], "--qk-layernorm"),
        (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
        (["--rotary-percent", "0.5"], "--rotary-percent"),
    ],
)
def test_a_run_contradicting_the_checkpoints_args_is_one_line(flags, named):
    with pytest.raises(CheckpointError) as e:
        _load(*flags)
    msg = str(e.value)
    assert "\n" not in msg and named in msg and "Megatron checkpoint" in msg, msg


def _args(**over) -> argparse.Namespace:
    base = dict(
        position_embedding_type="rope",
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        apply_layernorm_1p=False,
        squared_relu=False,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
    )
    return argparse.Namespace(**{**base, **over})


def _config(**over) -> GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=8,
        position_embedding_type="rope",
        add_bias_linear=False,
    )
    return GPTConfig(**{**base, **over})


def test_every_math_flag_is_read_from_args():
    for name, field, flag, default in megatron.MATH_FLAGS:
        value = 0.5 if isinstance(default, float) and name == "rotary_percent" else not default
        if name == "rope_scaling_factor":
            saved, now = (
                _args(use_rope_scaling=True, rope_scaling_factor=32.0),
                _config(use_rope_scaling=True),
            )
        else:
            saved, now = _args(**{name: value}), _config()
        with pytest.raises(CheckpointError, match=flag.replace("-", "\\-")):
            megatron.check_math_flags(saved, now, where="ckpt")
        if name != "rope_scaling_factor":  # the same setting on both sides loads
            megatron.check_math_flags(saved, _config(**{field: value}), where="ckpt")
    # Megatron's --add-qkv-bias is implied by biases on every linear layer (as megalite builds it)
    megatron.check_math_flags(
        _args(add_bias_linear=True), _config(add_bias_linear=True, add_qkv_bias=True), where="c"
    )
    # rotary settings do not matter to a learned-absolute model
    megatron.check_math_flags(
        _args(position_embedding_type="learned_absolute", rotary_percent=0.5),
        _config(position_embedding_type="learned_absolute"),
        where="c",
    )


def test_a_model_megalite_does_not_build_is_refused():
    with pytest.raises(CheckpointError, match="--multi-latent-attention") as e:
        megatron.check_math_flags(_args(multi_latent_attention=True), _config(), where="c")
    assert "\n" not in str(e.value)


def test_rampup_scheduler_position_is_megatrons_samples(monkeypatch):
    """The fixture as if saved under --rampup-batch-size 2 2 8: iteration 2, 6 samples."""
    opened = megatron.open_reader

    def as_ramped(iter_dir, fmt):
        reader = opened(iter_dir, fmt)
        reader.meta["consumed_train_samples"] = 6
        reader.meta["megatron_scheduler"] = {**reader.meta["megatron_scheduler"], "num_steps": 6}
        return reader

    monkeypatch.setattr(megatron.loading, "open_reader", as_ramped)
    ramp = "--lr-warmup-samples 8 --train-samples 24 --rampup-batch-size 2 2 8".split()
    flags = [*BASE, *MODEL, "--load", LEGACY, *ramp]
    for flag in ("--train-iters", "--train-iters", "--lr-warmup-iters"):  # sample-based instead
        i = flags.index(flag)
        del flags[i : i + 2]
    cfg = with_tokenizer(parse_args(flags, env={}))
    trainer, _ = trainer_and_data(cfg, ParallelState.single())
    loaded = checkpoint_io.load_checkpoint(trainer)
    assert loaded.progress.iteration == 2 and loaded.progress.consumed_train_samples == 6
    assert trainer.scheduler.num_steps == 1.5
    # Megatron's warmup at 6 of 8 warmup samples: 1e-3 * 6 / 8 (iteration 2 would give 1e-3)
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert abs(lr - 1e-3 * 6 / 8) < 1e-12, lr


def test_scheduler_position_conversions_are_inverse():
    for samples, gbs in ((8, 4), (6, 4), (10, 3), (0, 7)):
        steps = megatron.scheduler_steps_from_samples(samples, gbs)
        assert megatron.scheduler_samples_from_steps(steps, gbs) == samples
    assert megatron.scheduler_steps_from_samples(8, 4) == 2
    assert isinstance(megatron.scheduler_steps_from_samples(8, 4), int)
