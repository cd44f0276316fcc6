"""``--tensor-parallel-mode`` / ``--tensor-parallel-depth``: 1d by default (today's run), and each
wrong combination refused in one line that names the flags and numbers, before any process group
(``parse_args`` only validates)."""

from __future__ import annotations

import pytest

from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError
from tests.training.common import BASE


def _parse(extra: str, world: int):
    return parse_args(BASE + extra.split(), env={"RANK": "0", "WORLD_SIZE": str(world)})


def test_default_is_1d():
    cfg = _parse("--tensor-model-parallel-size 2", 2)
    assert (cfg.parallel.tensor_parallel_mode, cfg.parallel.tensor_parallel_depth) == ("1d", 1)


BAD = [
    (
        "--tensor-model-parallel-size 2 --tensor-parallel-mode 2d",
        2,
        "--tensor-model-parallel-size 2 is not q x q for --tensor-parallel-mode 2d; use one of 1, "
        "4, 9",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2.5d --tensor-parallel-depth 2",
        4,
        "--tensor-model-parallel-size 4 is not depth 2 x q x q for --tensor-parallel-mode 2.5d",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 3d",
        4,
        "--tensor-model-parallel-size 4 is not q x q x q for --tensor-parallel-mode 3d",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-depth 2",
        4,
        "--tensor-parallel-depth 2 applies to --tensor-parallel-mode 2.5d only",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --sequence-parallel",
        4,
        "--tensor-parallel-mode 2d does not combine with --sequence-parallel",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --context-parallel-size 2",
        8,
        "--tensor-parallel-mode 2d does not combine with --context-parallel-size 2",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --num-experts 4",
        4,
        "--tensor-parallel-mode 2d does not combine with --num-experts 4 (MoE)",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --ckpt-format torch_dist",
        8,
        "--tensor-parallel-mode 3d does not combine with --ckpt-format torch_dist (Megatron's "
        "formats hold 1d tensor-parallel shards); use --ckpt-format megalite (the default)",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --hidden-size 33 "
        "--num-attention-heads 3",
        4,
        "--hidden-size 33 is not divisible by the grid side q = 2",
    ),
    (
        "--tensor-model-parallel-size 9 --tensor-parallel-mode 2d --hidden-size 36 "
        "--num-attention-heads 4",
        9,
        "--num-attention-heads 4 is not divisible by the grid side q = 3",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --group-query-attention "
        "--num-query-groups 1",
        4,
        "--num-query-groups 1 is not divisible by the grid side q = 2",
    ),
    (
        "--tensor-model-parallel-size 4 --tensor-parallel-mode 2d --ffn-hidden-size 33",
        4,
        "--ffn-hidden-size 33 is not divisible by the grid side q = 2",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 2.5d --tensor-parallel-depth 2",
        8,
        "--micro-batch-size 2 is not divisible by --tensor-parallel-depth 2 x q 2 = 4",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d",
        8,
        "--micro-batch-size 2 is not divisible by 4 under --tensor-parallel-mode 3d",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4 "
        "--sequence-parallel",
        8,
        "--tensor-parallel-mode 3d does not combine with --sequence-parallel",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4 "
        "--hidden-size 34 --num-attention-heads 2",
        8,
        "--hidden-size 34 is not divisible by 4 under --tensor-parallel-mode 3d",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4 "
        "--num-attention-heads 1",
        8,
        "--num-attention-heads 1 is not divisible by 2 under --tensor-parallel-mode 3d",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4 "
        "--group-query-attention --num-query-groups 1",
        8,
        "--num-query-groups 1 is not divisible by 2 under --tensor-parallel-mode 3d",
    ),
    (
        "--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4 "
        "--ffn-hidden-size 66",
        8,
        "--ffn-hidden-size 66 is not divisible by 4 under --tensor-parallel-mode 3d",
    ),
]


def test_3d_is_accepted_with_tied_embeddings():
    cfg = _parse("--tensor-model-parallel-size 8 --tensor-parallel-mode 3d --micro-batch-size 4", 8)
    assert cfg.parallel.tensor_parallel_mode == "3d" and cfg.parallel.tp_split_size == 2
    assert not cfg.model.untie_embeddings_and_output_weights


@pytest.mark.parametrize("extra, world, message", BAD)
def test_wrong_combinations_are_refused_in_one_line(extra, world, message):
    with pytest.raises(ConfigError) as err:
        _parse(extra, world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
