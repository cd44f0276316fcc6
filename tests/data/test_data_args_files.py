"""``--data-args-path`` (a file holding the ``--data-path`` list, whitespace-separated)
and ``--per-split-data-args-path`` (JSON ``{"train": ..., "valid": ..., "test": ...}``, each a
list or one string), Megatron's formats, through ``pretrain_gpt.py``'s flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError
from tests.data.helpers import random_docs, write_dataset

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 2 "
    "--tokenizer-type NullTokenizer --vocab-size 127"
).split()


@pytest.fixture
def prefixes(tmp_path):
    rng = np.random.default_rng(0)
    return [
        write_dataset(tmp_path / name, random_docs(rng, 10, max_len=20, vocab=100, min_len=1))
        for name in ("a", "b", "c")
    ]


def test_data_args_path_is_the_data_path_list(tmp_path, prefixes):
    a, b, _ = prefixes
    path = tmp_path / "blend.txt"
    path.write_text(f"0.3 {a}\n0.7\t{b}\n")
    cfg = parse_args([*BASE, "--data-args-path", str(path), "--split", "90,10,0"])
    assert cfg.data.data_path == ["0.3", a, "0.7", b]
    assert cfg.data.split == "90,10,0"


def test_per_split_data_args_path_lists_or_strings(tmp_path, prefixes):
    a, b, c = prefixes
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": ["0.5", a, "0.5", b], "valid": f"{c}", "test": None}))
    cfg = parse_args([*BASE, "--per-split-data-args-path", str(path)])
    assert cfg.data.train_data_path == ["0.5", a, "0.5", b]
    assert cfg.data.valid_data_path == [c] and cfg.data.test_data_path is None


@pytest.mark.parametrize(
    ("flag", "content", "words"),
    [
        ("--data-args-path", "", ["is empty"]),
        ("--data-args-path", None, ["cannot read it"]),
        ("--data-args-path", "0.5 {tmp}/missing", ["missing.idx does not exist"]),
        ("--per-split-data-args-path", "{", ["not JSON"]),
        (
            "--per-split-data-args-path",
            '{"valid": []}',
            ['non-empty "train"'],
        ),
        ("--per-split-data-args-path", '{"train": {"x": 1}}', ["'train' must be a list"]),
    ],
)
def test_bad_files_are_one_line(tmp_path, prefixes, flag, content, words):
    path = tmp_path / "args"
    if content is not None:
        path.write_text(content.replace("{tmp}", str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, flag, str(path)])
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_data_args_path_conflicts_with_data_path(tmp_path, prefixes):
    path = tmp_path / "blend.txt"
    path.write_text(prefixes[0])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        parse_args([*BASE, "--data-args-path", str(path), "--data-path", prefixes[1]])
