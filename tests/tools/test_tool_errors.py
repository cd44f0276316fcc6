"""Every tool under its ``run_main`` guard: a bad input file, an unwritable or impossible output
folder, a truncated ``.gz``, an empty tokenizer input, a bad command line, a port in use at an srun
launch: one ``error:`` line naming the flag or file, a non-zero status, and no output left that
looks valid. In-process (stderr captured), plus one real process per kind of guard."""

from __future__ import annotations

import errno
import gzip
import json
import os
import socket

import pytest
import torch

from megalite.errors import run_main
from tests.user_errors import (
    dataset,
    files_under,
    one_error_line,
    read_only,
    run_in_process,
    run_script,
)
from tools import (
    build_data_cache,
    convert_checkpoint_to_hf,
    convert_hf_to_megalite,
    make_stdlib_corpus,
    merge_datasets,
    pipeline_timeline,
    plan,
    preprocess_data,
    train_tokenizer,
)

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _jsonl(path, texts, *, gz: bool = False, cut: int = 0) -> str:
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    if gz:
        data = gzip.compress(data)
    path.write_bytes(data[: len(data) - cut] if cut else data)
    return str(path)


def test_preprocess_data(tmp_path, capsys):
    pre = preprocess_data.main
    out = tmp_path / "out"
    good = _jsonl(tmp_path / "in.jsonl", ["1 2 3", "4 5"])
    # a file that is not a SentencePiece model
    bad_model = tmp_path / "bad.model"
    bad_model.write_text("not a model")
    argv = [
        "--input",
        good,
        "--output-prefix",
        out / "c",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        bad_model,
    ]
    status, err = run_in_process(pre, argv, capsys)
    assert status == 1
    one_error_line(err, f"--tokenizer-model {bad_model}", "not a SentencePiece model")
    # a truncated .jsonl.gz (EOFError inside gzip)
    many = [" ".join(str(i % 90) for i in range(j, j + 30)) for j in range(300)]
    cut = _jsonl(tmp_path / "cut.jsonl.gz", many, gz=True, cut=40)
    argv = ["--input", cut, "--output-prefix", out / "c", *NULL]
    status, err = run_in_process(pre, argv, capsys)
    assert status == 1
    one_error_line(err, f"--input {cut}", "truncated gzip file")
    assert files_under(out) == []
    # an output folder that cannot be created, one that cannot be written
    (tmp_path / "f").write_text("x")
    argv = ["--input", good, "--output-prefix", tmp_path / "f" / "sub" / "c", *NULL]
    status, err = run_in_process(pre, argv, capsys)
    assert status == 1
    one_error_line(err, "--output-prefix", "cannot create the folder")
    with read_only(tmp_path / "ro") as ok:
        if ok:
            argv = ["--input", good, "--output-prefix", tmp_path / "ro" / "c", *NULL]
            status, err = run_in_process(pre, argv, capsys)
            assert status == 1
            one_error_line(err, f"--output-prefix {tmp_path / 'ro'}", "cannot write")
    assert files_under(tmp_path / "ro") == []
    # a bad command line: one line, status 2
    status, err = run_in_process(pre, [*argv, "--bogus"], capsys)
    assert status == 2
    one_error_line(err, "--bogus", "--help")


def test_preprocess_on_a_full_disk_keeps_nothing(tmp_path, capsys, monkeypatch):
    import builtins

    import megalite.data.indexed_dataset as indexed_module

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "simulated")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def full_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return Full(f) if "w" in mode and ".idx" in str(path) else f

    monkeypatch.setattr(indexed_module, "open", full_open, raising=False)
    good = _jsonl(tmp_path / "in.jsonl", ["1 2 3", "4 5"])
    out = tmp_path / "out"
    argv = ["--input", good, "--output-prefix", out / "c", *NULL]
    status, err = run_in_process(preprocess_data.main, argv, capsys)
    assert status == 1
    one_error_line(err, f"--output-prefix {out / 'c'}", "no space left on the device")
    assert files_under(out) == []


def test_an_empty_corpus_gives_an_empty_dataset_that_pretraining_refuses(tmp_path, capsys):
    from pretrain_gpt import main as pretrain_main
    from tests.user_errors import TINY

    empty = _jsonl(tmp_path / "empty.jsonl", [])
    argv = ["--input", empty, "--output-prefix", tmp_path / "e", *NULL, "--append-eod"]
    assert preprocess_data.main([str(a) for a in argv]) == 0
    prefix = str(tmp_path / "e_text_document")
    status, err = run_in_process(pretrain_main, [*TINY, "--data-path", prefix], capsys)
    assert status == 1
    one_error_line(err, prefix, "holds no tokens (0 documents)")


def test_train_tokenizer(tmp_path, capsys):
    tok = train_tokenizer.main
    empty = _jsonl(tmp_path / "empty.jsonl", ["", "   "])
    argv = ["--input", empty, "--model-prefix", tmp_path / "m" / "tok", "--vocab-size", "300"]
    status, err = run_in_process(tok, argv, capsys)
    assert status == 1
    one_error_line(err, f"--input {empty}", "no text under --json-keys text")
    many = [f"word{i} and more words {i * 7}" for i in range(2000)]
    cut = _jsonl(tmp_path / "cut.jsonl.gz", many, gz=True, cut=64)
    argv = ["--input", cut, "--model-prefix", tmp_path / "m" / "tok", "--vocab-size", "300"]
    status, err = run_in_process(tok, argv, capsys)
    assert status == 1
    one_error_line(err, f"--input {cut}", "truncated gzip file")
    assert files_under(tmp_path / "m") == []


def test_conversion_tools(tmp_path, capsys):
    import transformers

    blocker = tmp_path / "f"
    blocker.write_text("x")
    # HF -> megalite: an impossible --save, then a corrupt weights file
    hf = tmp_path / "hf"
    transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2
    ).save_pretrained(hf)
    (hf / "model.safetensors").write_bytes(b"\x00" * 50)
    to_megalite = convert_hf_to_megalite.main
    status, err = run_in_process(to_megalite, ["--load", hf, "--save", blocker / "x"], capsys)
    assert status == 1
    one_error_line(err, f"--save {blocker / 'x'}", "cannot create the folder")
    status, err = run_in_process(
        to_megalite, ["--load", hf, "--save", tmp_path / "m" / "c"], capsys
    )
    assert status == 1
    one_error_line(err, f"--load {hf}", "cannot read model.safetensors")
    # megalite -> HF: an impossible --save is found before the checkpoint is read
    to_hf = convert_checkpoint_to_hf.main
    status, err = run_in_process(to_hf, ["--load", tmp_path / "m", "--save", blocker / "y"], capsys)
    assert status == 1
    one_error_line(err, f"--save {blocker / 'y'}")
    # a checkpoint that is not there: refused, and no --save folder (nor its parents) made
    status, err = run_in_process(
        to_hf, ["--load", tmp_path / "m", "--save", tmp_path / "h"], capsys
    )
    assert status == 1
    one_error_line(err, str(tmp_path / "m"))
    # a failed conversion leaves nothing that looks like output: no folder, no partial sibling
    assert sorted(os.listdir(tmp_path)) == ["f", "hf"]
    # a folder the user had is kept as it was
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    status, err = run_in_process(to_megalite, ["--load", hf, "--save", mine], capsys)
    assert status == 1
    assert files_under(mine) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == [
        "f",
        "hf",
        "mine",
    ]


def test_dataset_tools(tmp_path, capsys):
    prefix = dataset(tmp_path, "d")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(10)
    status, err = run_in_process(
        merge_datasets.main, ["--input", prefix, "--output-prefix", tmp_path / "m"], capsys
    )
    assert status == 1
    one_error_line(err, prefix + ".idx", "truncated index")
    assert not (tmp_path / "m.idx").exists() and not (tmp_path / "m.bin").exists()
    argv = [
        "--data-path",
        prefix,
        *"--seq-length 8 --global-batch-size 4 --train-iters 2".split(),
    ]
    status, err = run_in_process(build_data_cache.main, argv, capsys)
    assert status == 1
    one_error_line(err, prefix + ".idx")
    good = dataset(tmp_path, "good")  # a good one: the token-id range is cached with the indices
    argv[1] = good
    assert build_data_cache.main([*map(str, argv), "--data-cache-path", str(tmp_path / "c")]) == 0
    assert [f for f in os.listdir(tmp_path / "c") if "TokenRange" in f]
    (tmp_path / "f").write_text("x")
    status, err = run_in_process(
        make_stdlib_corpus.main, ["--output", tmp_path / "f" / "c.jsonl"], capsys
    )
    assert status == 1
    one_error_line(err, f"--output {tmp_path / 'f' / 'c.jsonl'}")
    status, err = run_in_process(
        pipeline_timeline.main, [tmp_path / "none.json", tmp_path / "o.svg"], capsys
    )
    assert status == 1
    one_error_line(err, str(tmp_path / "none.json"))


def test_plan_refuses_an_unwritable_calibration_file_before_calibrating(
    tmp_path, capsys, monkeypatch
):
    from tools.planner import calibrate

    def no_calibration():
        raise AssertionError("calibrated before checking --calibration-out")

    monkeypatch.setattr(calibrate, "calibrate", no_calibration)
    blocker = tmp_path / "f"
    blocker.write_text("x")
    folder = tmp_path / "ro"
    (tmp_path / "taken").mkdir()
    cases = [
        (blocker / "c.json", "cannot create its folder"),  # a file where its folder should be
        (tmp_path / "taken", "is a folder; give a file path for the calibration"),
    ]
    with read_only(folder) as ok:
        if ok:
            cases.append((folder / "c.json", "cannot write it ("))
        for out, needle in cases:
            argv = ["--calibrate", "--calibration-out", out]
            status, err = run_in_process(plan.main, argv, capsys)
            assert status == 1
            one_error_line(err, "--calibration-out", str(out), needle, "give a")
    # a real process: the same line, no traceback
    proc = run_script("tools/plan.py", ["--calibrate", "--calibration-out", blocker / "c.json"])
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc.stderr, f"--calibration-out {blocker / 'c.json'}", "cannot create")


def test_port_in_use_under_srun_is_one_line(capsys):
    from megalite.training.launch import detect_launch, init_distributed

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        launch = detect_launch(env)

        def join(argv):
            init_distributed(launch, torch.device("cpu"), timeout_minutes=0.2)

        status, err = run_in_process(lambda argv: run_main(join, argv), [], capsys)
    assert status == 1
    one_error_line(err, f"MASTER_PORT {port}", "is in use")


def test_a_real_tool_process_exits_non_zero_with_one_line(tmp_path):
    cut = _jsonl(tmp_path / "cut.jsonl.gz", ["1 2 3"] * 500, gz=True, cut=30)
    proc = run_script(
        "tools/preprocess_data.py", ["--input", cut, "--output-prefix", tmp_path / "o", *NULL]
    )
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc.stderr, cut, "truncated gzip file")
    assert files_under(tmp_path) == ["cut.jsonl.gz"]


def test_a_bug_still_shows_its_traceback():
    """run_main turns user errors into one line, never a bug: anything else propagates."""

    def broken(argv):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        run_main(broken, [])
