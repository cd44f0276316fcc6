"""What a ``pretrain_gpt.py`` user reads: the errors of ``models/`` and ``core/`` name parameters,
and ``flag_message`` (the flag layer) rewrites them into Megatron's flags. These are the flag-named
expectations that tests/models/test_config.py and tests/models/test_gpt_pipeline.py held before
the messages moved to parameter names; each is checked through the flag layer, unchanged."""

from __future__ import annotations

import re

import pytest

from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.models import GPTConfig
from megalite.training.arguments import flag_message, parse_args
from megalite.training.config import ConfigError
from tests.training.common import BASE as FLAGS

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100, seq_length=16)

BAD = [
    # (overrides, tp, pp, the message must contain)
    (
        dict(num_attention_heads=6, hidden_size=60),
        4,
        1,
        "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
    ),
    (
        dict(num_query_groups=2),
        4,
        1,
        "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
    ),
    (
        dict(num_query_groups=3),
        1,
        1,
        "--num-attention-heads 8 is not divisible by --num-query-groups 3",
    ),
    (
        dict(ffn_hidden_size=100),
        8,
        1,
        "--ffn-hidden-size 100 is not divisible by --tensor-model-parallel-size 8",
    ),
    (
        dict(sequence_parallel=True, seq_length=18, max_position_embeddings=32),
        4,
        1,
        "--seq-length 18 is not divisible by --tensor-model-parallel-size 4 under "
        "--sequence-parallel",
    ),
    (dict(), 1, 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (
        dict(seq_length=32, max_position_embeddings=16),
        1,
        1,
        "--seq-length 32 exceeds --max-position-embeddings 16",
    ),
    (dict(position_embedding_type="alibi"), 1, 1, "--position-embedding-type must be one of"),
    (dict(normalization="BatchNorm"), 1, 1, "--normalization must be one of"),
    (dict(attention_backend="flash"), 1, 1, "--attention-backend must be one of sdpa, unfused"),
    (
        dict(recompute_granularity="full"),
        1,
        1,
        "--recompute-granularity full needs --recompute-method",
    ),
    (
        dict(recompute_granularity="selective", recompute_method="block"),
        1,
        1,
        "--recompute-method block applies only to --recompute-granularity full",
    ),
    (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
        1,
        1,
        "--recompute-num-layers must be >= 1",
    ),
    (dict(position_embedding_type="rope", kv_channels=7), 1, 1, "even head dim"),
    (dict(hidden_dropout=1.0), 1, 1, "--hidden-dropout must be in [0, 1)"),
]


def _flag_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        fn(*args, **kwargs)
    text = flag_message(str(err.value))
    assert "\n" not in text
    return text


@pytest.mark.parametrize("overrides,tp,pp,message", BAD)
def test_model_layout_errors_read_as_flags(overrides, tp, pp, message):
    config = GPTConfig(**{**BASE, **overrides})
    assert message in _flag_error(config.validate, tp_size=tp, pp_size=pp)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden_size=60), "--hidden-size 60 is not divisible by --num-attention-heads 8"),
        (dict(num_layers=0), "--num-layers must be an integer >= 1, got 0"),
        (dict(seq_length=0), "--seq-length must be an integer >= 1, got 0"),
        (dict(vocab_size=None), "--vocab-size must be an integer >= 1, got None"),
    ],
)
def test_construction_errors_read_as_flags(overrides, message):
    assert re.search(re.escape(message), _flag_error(GPTConfig, **{**BASE, **overrides}))


def test_stage_errors_read_as_flags():
    text = _flag_error(stage_layer_ranges, 7, 2)
    assert re.search(r"--num-layers 7 is not divisible by .*-size 2", text)
    text = _flag_error(stage_layer_ranges, 7, 3, first_stage_layers=2)
    assert re.search(r"--num-layers 7 minus .* \(2\) leaves 5, .* 2 pipeline", text)
    text = _flag_error(stage_layer_ranges, 4, 1, first_stage_layers=2)
    assert re.search(r"needs --pipeline-model-parallel-size > 1", text)


def test_flag_message_rewrites_names_only():
    assert flag_message("num_layers 3 is not divisible by pp_size 2") == (
        "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"
    )
    # flags stay flags; paths, dotted names, English words and values are left alone
    for text in (
        "--num-layers 3 is bad",
        "/data/num_layers.idx does not exist",
        "model.vocab_size 99 differs",
        "leaves 2, which does not split evenly over the stages",
        "got 'learned_absolute'",
    ):
        assert flag_message(text) == text
    assert flag_message("fp16 and bf16 are mutually exclusive") == (
        "--fp16 and --bf16 are mutually exclusive"
    )


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "pipeline_schedule must be one of 1f1b, gpipe, got 'zb'",
            "--pipeline-schedule must be one of 1f1b, gpipe, got 'zb'",
        ),
        (
            "pipeline_schedule zbv holds exactly 2 chunks per rank in a V, got "
            "num_virtual_stages_per_pipeline_rank 3",
            "--pipeline-schedule zbv holds exactly 2 chunks per rank in a V, got "
            "--num-virtual-stages-per-pipeline-rank 3",
        ),
        (
            "num_attention_heads 6 is not divisible by tensor_model_parallel_size 4",
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            "data_parallel_sharding_strategy 'zero' is not one of no_shard, optim",
            "--data-parallel-sharding-strategy 'zero' is not one of no_shard, optim",
        ),
        (
            "cp_comm_type must be one of p2p, a2a, all_gather, got 'ring'",
            "--cp-comm-type must be one of p2p, a2a, all_gather, got 'ring'",
        ),
        (
            "seed must be an integer >= 0, got -1; exit_signal 'X' is not a signal",
            "--seed must be an integer >= 0, got -1; --exit-signal 'X' is not a signal",
        ),
    ],
)
def test_flag_message_translates_core_parameters(message, expected):
    """core and models name parameters by the config fields they take, which are the flags'
    dests; the flag layer writes each as its flag."""
    assert flag_message(message) == expected


def test_flag_message_keeps_flags_and_other_names():
    for text in (
        # a message that spells the flag already is left as it is
        "--pipeline-schedule zbv holds exactly 2 chunks per rank in a V, got "
        "--num-virtual-stages-per-pipeline-rank 3",
        # a parameter no flag sets stays a name
        "num_microbatches >= 2 x pp = 8, got 4",
        # values that look like names: a schedule, a strategy
        "got 'optim_grads_params' and interleaved-1f1b",
    ):
        assert flag_message(text) == text


def test_errors_of_core_checks_reach_the_user_as_flags():
    """A layout that the pipeline schedules' own check refuses, through parse_args: flags only."""
    pipeline = "--num-layers 8 --pipeline-model-parallel-size 2 --pipeline-schedule zbv"
    argv = [*FLAGS, *pipeline.split(), "--num-virtual-stages-per-pipeline-rank", "3"]
    with pytest.raises(ConfigError) as err:
        parse_args(argv, env={"RANK": "0", "WORLD_SIZE": "2"})
    text = str(err.value)
    assert "--pipeline-schedule zbv" in text and "--num-virtual-stages-per-pipeline-rank 3" in text
    assert not re.search(r"(?<![\w-])[a-z]+_[a-z_]+", text), text  # no parameter name left


def test_onebit_lamb_factor_flags_reach_the_optimizer_and_are_checked():
    """The factor's three knobs land in the compression spec; bounds that exclude 1 (the factor
    the compressed phase starts from) are refused in the flags' words."""
    argv = [*FLAGS, "--optimizer", "onebit-lamb", "--onebit-lamb-factor-max", "2"]
    argv += ["--onebit-lamb-factor-min", "0.25", "--onebit-lamb-factor-threshold", "0.05"]
    spec = parse_args(argv, env={}).optimizer.compression()
    assert (spec.factor_min, spec.factor_max, spec.factor_threshold) == (0.25, 2.0, 0.05)
    with pytest.raises(ConfigError) as err:
        parse_args([*FLAGS, "--onebit-lamb-factor-min", "1.5"], env={})
    assert "--onebit-lamb-factor-min" in str(err.value)
