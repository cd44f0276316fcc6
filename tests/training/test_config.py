"""The config dataclasses check themselves: a config built in code is refused exactly as one parsed
from flags; num_microbatches comes from the mesh's DP size; a config parsed for one world size is
refused on another before any data is read; the tokenizer is built after parsing."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megalite.data.config import DataConfig
from megalite.errors import ConfigError
from megalite.models.config import GPTConfig
from megalite.training import pretrain as pretrain_module
from megalite.training.arguments import build_parser, parse_args
from megalite.training.config import LoggingConfig, PretrainConfig, TrainingConfig, with_tokenizer
from megalite.training.megatron_flags import REFUSED_FLAGS
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.parallel_config import ParallelConfig
from tests.training.common import BASE


def _cfg(**sections) -> PretrainConfig:
    """A valid tiny config built in code (no flags), with ``sections`` replaced."""
    model = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=0, seq_length=16, seed=7
    )
    parts = dict(
        model=model,
        parallel=ParallelConfig(),
        optimizer=OptimizerConfig(lr=1e-3),
        data=DataConfig(mock_data=True, vocab_size=127),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=5),
        logging=LoggingConfig(),
    )
    parts.update(sections)
    return PretrainConfig(**parts)


def test_code_built_config_fills_the_vocab_and_validates():
    cfg = with_tokenizer(_cfg())
    assert cfg.model.vocab_size == 128 and cfg.tokenizer.eod == 127  # 127 ids + eod
    assert cfg.parallel.world_size is None and cfg.parallel.data_parallel_size is None
    assert cfg.check_world(4, 4) == 1 and cfg.training.num_microbatches(2) == 2
    assert with_tokenizer(cfg) is cfg  # built already: only validated


BAD = [
    (dict(parallel=ParallelConfig(overlap_grad_reduce=True)),
     "overlap_grad_reduce is implemented for use_distributed_optimizer only"),
    (dict(parallel=ParallelConfig(tensor_model_parallel_size=0)),
     "tensor_model_parallel_size must be an integer >= 1, got 0"),
    (dict(parallel=ParallelConfig(tensor_model_parallel_size=3)),
     "num_attention_heads 4 is not divisible by tp_size 3"),
    (dict(parallel=ParallelConfig(world_size=6, tensor_model_parallel_size=4)),
     "world size 6 is not divisible by tensor_model_parallel_size 4"),
    (dict(parallel=ParallelConfig(world_size=8)),
     "global_batch_size 8 is not divisible by micro_batch_size 2 x data-parallel size 8 = 16"),
    (dict(parallel=ParallelConfig(pipeline_schedule="zb")), "pipeline_schedule must be one of"),
    (dict(optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=9)),
     "lr_warmup_iters 9 exceeds lr_decay_iters 5 (= train_iters)"),
    (dict(optimizer=OptimizerConfig(lr=1e-3, lr_decay_style="step")), "lr_decay_style must be"),
    (dict(training=TrainingConfig(micro_batch_size=3, global_batch_size=8)),
     "global_batch_size 8 is not divisible by micro_batch_size 3 x data-parallel size 1 = 3"),
    (dict(training=TrainingConfig(global_batch_size=8, save_interval=5)),
     "save_interval 5 needs save DIR"),
    (dict(training=TrainingConfig(global_batch_size=8, finetune=True)),
     "finetune needs load DIR"),
    (dict(training=TrainingConfig(global_batch_size=8, exit_signal="NOPE")),
     "is not a signal"),
    (dict(logging=LoggingConfig(log_interval=0)), "log_interval must be >= 1, got 0"),
    (dict(model=GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=0,
                          seq_length=16, seed=7, decoder_first_pipeline_num_layers=1)),
     "first_stage_layers needs pp_size > 1"),
    (dict(model=GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99,
                          seq_length=16, seed=7)),
     "model.vocab_size 99 differs from the tokenizer's 128"),
]  # fmt: skip


@pytest.mark.parametrize("sections, message", BAD, ids=[m[:40] for _, m in BAD])
def test_code_built_configs_are_refused_in_one_line(sections, message):
    with pytest.raises(ConfigError) as err:
        with_tokenizer(_cfg(**sections))
    text = str(err.value)
    assert message in text and "\n" not in text and "--" not in text, text


def test_num_microbatches_names_the_three_numbers_and_the_fix():
    t = TrainingConfig(micro_batch_size=2, global_batch_size=12)
    assert t.num_microbatches(3) == 2
    with pytest.raises(ConfigError) as err:
        t.num_microbatches(4)
    assert str(err.value) == (
        "global_batch_size 12 is not divisible by micro_batch_size 2 x data-parallel size 4 = 8; "
        "use a multiple of 8, or change micro_batch_size or the data-parallel size"
    )


def test_a_config_parsed_for_one_world_is_refused_on_another():
    cfg = parse_args(BASE, env={"RANK": "0", "WORLD_SIZE": "4"})
    assert cfg.parallel.world_size == 4 and cfg.check_world(4, 4) == 1
    with pytest.raises(ConfigError) as err:
        cfg.check_world(2, 2)
    text = str(err.value)
    assert "parsed for a world of 4 ranks but is running on 2: " in text and "\n" not in text


def test_pretrain_refuses_another_world_before_reading_data(monkeypatch):
    """Parsed for 2 ranks, run in one plain process: one line, no model and no data built."""
    cfg = parse_args(BASE, env={"RANK": "0", "WORLD_SIZE": "2"})

    def not_reached(*args, **kwargs):
        raise AssertionError("built before the world was checked")

    monkeypatch.setattr(pretrain_module, "build_data_loaders", not_reached)
    monkeypatch.setattr(pretrain_module, "Trainer", not_reached)
    with pytest.raises(ConfigError, match="parsed for a world of 2 ranks but is running on 1: "):
        pretrain_module.pretrain(cfg, env={})


def test_the_tokenizer_is_built_after_parsing(tmp_path):
    """parse_args does not open a tokenizer model; with_tokenizer does (and refuses a bad one)."""
    model = tmp_path / "tok.model"
    model.write_bytes(b"not a sentencepiece model")
    argv = [a for a in BASE if a not in ("--vocab-size", "127")]
    argv = [
        *argv[: argv.index("NullTokenizer")],
        "SentencePieceTokenizer",
        *argv[argv.index("NullTokenizer") + 1 :],
        "--tokenizer-model",
        str(model),
    ]
    cfg = parse_args(argv, env={})
    assert cfg.tokenizer is None and cfg.model.vocab_size == 0
    with pytest.raises(ConfigError) as err:
        with_tokenizer(cfg)
    assert "\n" not in str(err.value)


def test_flag_defaults_are_the_dataclass_defaults():
    """Written once: every flag that fills a field has that field's default."""
    sources = (
        GPTConfig,
        ParallelConfig,
        OptimizerConfig,
        TrainingConfig,
        DataConfig,
        LoggingConfig,
    )
    checked = 0
    # None: micro x DP, --train-samples; not given (10 min, the hang watchdog off)
    derived = {"global_batch_size", "train_iters", "distributed_timeout_minutes"}
    for action in build_parser()._actions:
        for cls in sources:
            field = {f.name: f for f in dataclasses.fields(cls)}.get(action.dest)
            if field is None or field.default is dataclasses.MISSING or action.dest in derived:
                continue
            if action.required:  # --seq-length: required of the user, defaulted for code
                continue
            assert action.default == field.default, (action.dest, cls.__name__)
            checked += 1
    assert checked > 60


def test_refused_megatron_flags_say_why():
    # the MoE and context-parallel flags parse; a Megatron flag megalite refuses names the reason
    assert parse_args([*BASE, "--num-experts", "8"], env={}).model.num_experts == 8
    cfg = parse_args([*BASE, "--context-parallel-size", "1"], env={})
    assert cfg.parallel.context_parallel_size == 1
    for flag, why in REFUSED_FLAGS.items():
        expected = rf"^unknown flag {flag}: not implemented \({re.escape(why)}\); remove it to run$"
        with pytest.raises(ConfigError, match=expected):
            parse_args([*BASE, flag, "1"], env={})
