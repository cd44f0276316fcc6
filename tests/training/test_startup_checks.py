"""pretrain_gpt.py's start-up checks: each user mistake is one ``error:`` line naming the flag or
file, a non-zero status, found before any process group or model (in well under 30 s), with
nothing valid-looking left behind. Run in-process through the guarded ``main`` (stderr captured),
plus one real subprocess for the exit status and the absence of a traceback."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pretrain_gpt import main
from tests.user_errors import (
    TINY,
    dataset,
    files_under,
    good_docs,
    one_error_line,
    run_in_process,
    run_script,
)


def _corrupt(prefix: str, how: str) -> None:
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if how == "truncated_idx":
        idx.write_bytes(idx.read_bytes()[:20])
    elif how == "foreign_idx":
        idx.write_bytes(b"not an index at all" * 5)
    elif how == "wrong_version":
        data = bytearray(idx.read_bytes())
        struct.pack_into("<Q", data, 9, 2)
        idx.write_bytes(bytes(data))
    elif how == "short_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])


@pytest.mark.parametrize(
    "how, needle",
    [
        ("truncated_idx", "truncated index"),
        ("foreign_idx", "wrong magic"),
        ("wrong_version", "unsupported index version 2"),
        ("short_bin", "describes"),
    ],
)
def test_malformed_dataset_is_one_line_before_the_model(tmp_path, capsys, how, needle):
    prefix = dataset(tmp_path, "d")
    _corrupt(prefix, how)
    save = tmp_path / "ckpt"
    status, err = run_in_process(main, [*TINY, "--data-path", prefix, "--save", save], capsys)
    assert status == 1
    one_error_line(err, needle, str(tmp_path / "d"))
    assert files_under(save) == [] and not dist.is_initialized()


def test_token_ids_outside_the_vocabulary_never_train(tmp_path, capsys, monkeypatch):
    # beyond the padded vocabulary (TP 1: would be an IndexError in the embedding)
    beyond = dataset(tmp_path, "beyond", good_docs() + [[5, 200, 7]])
    status, err = run_in_process(main, [*TINY, "--data-path", beyond], capsys)
    assert status == 1
    one_error_line(
        err,
        "--data-path",
        beyond + ".bin",
        "largest token id 200",
        "128 ids",
        "padded vocabulary of 128",
    )
    # between the tokenizer's 128 ids and the padded 256 rows: would train silently
    padding = dataset(tmp_path, "padding", good_docs() + [[130]])
    pad_flags = [*TINY, "--make-vocab-size-divisible-by", "256", "--data-path", padding]
    status, err = run_in_process(main, pad_flags, capsys)
    assert status == 1
    one_error_line(err, padding + ".bin", "largest token id 130", "padding rows 128..255")
    # TP 2 (the vocab-parallel embedding would mask the ids): refused before any process group
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    tp2 = [*TINY, "--tensor-model-parallel-size", "2", "--data-path"]
    for prefix, needle in ((beyond, "largest token id 200"), (padding, "largest token id 130")):
        status, err = run_in_process(main, [*tp2, prefix], capsys)
        assert status == 1
        one_error_line(err, "rank 0: ", prefix + ".bin", needle)
        assert not dist.is_initialized()
    # the eod id (127) itself is in the vocabulary: such data trains
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    edge = dataset(tmp_path, "edge", good_docs() + [[127, 126, 0]])
    status, err = run_in_process(main, [*TINY, "--data-path", edge], capsys)
    assert status == 0, err


def test_token_range_is_computed_once_and_cached(tmp_path, monkeypatch):
    from megalite.data import vocab_check
    from megalite.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(dataset(tmp_path, "c", good_docs() + [[3, 99]]))
    cache = str(tmp_path / "cache")
    assert vocab_check.token_range(ds, cache_dir=cache) == (0, 126)
    assert any("TokenRange" in f for f in os.listdir(cache))

    def no_scan(indexed):
        raise AssertionError("scanned again despite a valid cache entry")

    empty = IndexedDataset(dataset(tmp_path, "e", []))
    assert vocab_check.token_range(empty, cache_dir=cache) is None
    monkeypatch.setattr(vocab_check, "scan_token_range", no_scan)
    assert vocab_check.token_range(ds, cache_dir=cache) == (0, 126)
    assert vocab_check.token_range(empty, cache_dir=cache) is None


@pytest.mark.parametrize(
    "docs, extra, needles",
    [
        ([], [], ["--data-path", "holds no tokens (0 documents)", "nothing to train on"]),
        ([[]] * 5, [], ["holds no tokens (5 documents)"]),
        (None, ["--split", "1,999,0"], ["--split 1,999,0 gives the train split", "no documents"]),
        (None, ["--split", "0,100,0"], ["--split 0,100,0 gives the train split no share"]),
    ],
)
def test_empty_train_data_is_one_line(tmp_path, capsys, docs, extra, needles):
    prefix = dataset(tmp_path, "d", docs)
    status, err = run_in_process(main, [*TINY, "--data-path", prefix, *extra], capsys)
    assert status == 1
    one_error_line(err, *needles)


def test_empty_evaluation_data(tmp_path, capsys):
    good, empty = dataset(tmp_path, "good"), dataset(tmp_path, "empty", [])
    flags = [*TINY, "--eval-iters", "1", "--eval-interval", "2"]
    argv = [*flags, "--train-data-path", good, "--valid-data-path", empty]
    status, err = run_in_process(main, argv, capsys)
    assert status == 1
    one_error_line(err, "--valid-data-path", empty, "nothing to evaluate on")
    # a --split that leaves the valid split of one dataset empty: a warning, no evaluation
    status, err = run_in_process(main, [*flags, "--data-path", good, "--split", "90,10,0"], capsys)
    assert status == 0, err
    assert main([*flags, "--data-path", good, "--split", "99,1,0"]) == 0
    out, err = capsys.readouterr()
    assert "gives the valid split" in out + err and "no valid evaluation in this run" in out + err


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path"])
def test_unwritable_output_folder_is_found_at_start_up(tmp_path, capsys, flag):
    prefix = dataset(tmp_path, "d")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    target = blocker / "out"
    status, err = run_in_process(main, [*TINY, "--data-path", prefix, flag, target], capsys)
    assert status == 1
    one_error_line(err, f"{flag} {target}", "cannot create the folder")
    assert files_under(tmp_path / "cache") == []  # no index built: found before the data


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_on_a_cpu_only_machine(capsys):
    argv = [*TINY[: TINY.index("--device")], "--mock-data", "--distributed-backend", "nccl"]
    status, err = run_in_process(main, argv, capsys)
    assert status == 2
    one_error_line(err, "--distributed-backend nccl", "no GPU")


def test_a_real_process_exits_non_zero_with_one_line(tmp_path):
    prefix = dataset(tmp_path, "d")
    _corrupt(prefix, "truncated_idx")
    proc = run_script("pretrain_gpt.py", [*TINY, "--data-path", prefix])
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc.stderr, prefix + ".idx", "truncated index")
    assert np.all([not line.startswith("[rank") for line in proc.stderr.splitlines()])
