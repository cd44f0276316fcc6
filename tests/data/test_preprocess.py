"""tools/preprocess_data.py: jsonl -> .bin/.idx holds exactly the tokenizer's ids per document
(plus eod with --append-eod); 1 and 2 workers give the same bytes; every bad input is an error
naming the file and line (or skipped and counted); a failed or killed run leaves no valid-looking
dataset."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.null_tokenizer import NullTokenizer
from megalite.data.preprocess import PreprocessError, preprocess_jsonl
from megalite.data.sentencepiece_tokenizer import SentencePieceTokenizer
from megalite.data.tokenizers import make_tokenizer
from tests.data.helpers import REPO, files_in, write_jsonl


def _read_all(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("append_eod", [False, True])
def test_sentencepiece_round_trip(tmp_path, corpus_jsonl, sp_model, append_eod):
    tok = SentencePieceTokenizer(sp_model)
    stats = preprocess_jsonl(
        corpus_jsonl, str(tmp_path / "c"), tok, append_eod=append_eod, chunk_lines=37
    )
    texts = [json.loads(line)["text"] for line in open(corpus_jsonl, encoding="utf-8")]
    want = [tok.tokenize(t) + ([tok.eod] if append_eod else []) for t in texts]
    assert _read_all(str(tmp_path / "c_text_document")) == want
    assert IndexedDataset(str(tmp_path / "c_text_document")).dtype == np.uint16
    assert stats.documents["text"] == 300 and stats.tokens["text"] == sum(map(len, want))
    two = str(tmp_path / "two")
    preprocess_jsonl(corpus_jsonl, two, tok, append_eod=append_eod, chunk_lines=37, workers=2)
    for ext in (".bin", ".idx"):
        one_bytes = (tmp_path / f"c_text_document{ext}").read_bytes()
        assert (tmp_path / f"two_text_document{ext}").read_bytes() == one_bytes


def test_null_tokenizer_round_trip_keys_gzip_and_workers(tmp_path):
    rng = np.random.default_rng(0)
    records = []
    for i in range(500):
        ids = rng.integers(0, 70000, size=int(rng.integers(1, 30)))
        records.append({"text": " ".join(map(str, ids)), "title": str(i), "other": 1})
    src = write_jsonl(tmp_path / "ids.jsonl", records)
    with open(src, "rb") as f, gzip.open(tmp_path / "ids.jsonl.gz", "wb") as g:
        g.write(f.read())
    tok = NullTokenizer(70000)  # vocab 70001 >= 65500: int32
    outputs = {}
    for workers, path in ((1, src), (2, str(tmp_path / "ids.jsonl.gz"))):
        prefix = str(tmp_path / f"w{workers}" / "ids")
        preprocess_jsonl(
            path,
            prefix,
            tok,
            json_keys=["text", "title"],
            append_eod=True,
            workers=workers,
            chunk_lines=16,
        )
        outputs[workers] = prefix
    for key in ("text", "title"):
        want = [[int(x) for x in r[key].split()] + [70000] for r in records]
        one = outputs[1] + f"_{key}_document"
        assert _read_all(one) == want
        assert IndexedDataset(one).dtype == np.int32
        for ext in (".bin", ".idx"):
            a = open(one + ext, "rb").read()
            b = open(outputs[2] + f"_{key}_document" + ext, "rb").read()
            assert a == b, f"workers 1 and 2 differ in {key}{ext}"


def test_cli_flags_and_progress(tmp_path, capsys, caplog):
    from tools.preprocess_data import main

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i} {i + 1}"} for i in range(50)])
    argv = [
        "--input",
        src,
        "--output-prefix",
        str(tmp_path / "out" / "p"),
        *"--tokenizer-type NullTokenizer --vocab-size 100 --append-eod --workers 2".split(),
        *"--log-interval 10 --json-keys text --chunk-lines 5".split(),
    ]
    caplog.set_level("INFO")
    assert main(argv) == 0
    assert _read_all(str(tmp_path / "out" / "p_text_document"))[3] == [3, 4, 100]
    log = caplog.text
    assert "processed 10 documents (" in log and "docs/s" in log and "MB/s" in log
    assert "elapsed" in log and "done: 50 lines (0 blank, 0 bad skipped)" in log


HANG_GUARD_S = 300  # a subprocess start and its end on a loaded machine take seconds, not minutes
BAD_CASES = [
    ('{"text": "1 2"', r"bad\.jsonl:3: malformed JSON \(Expecting ',' delimiter"),
    ('{"body": "1 2"}', r"bad\.jsonl:3: missing key 'text' \(keys present: \['body'\]\)"),
    ('{"text": 5}', r"bad\.jsonl:3: key 'text' holds int, expected a string"),
    ("[1, 2]", r"bad\.jsonl:3: expected a JSON object, got list"),
    ('{"text": "1 x"}', r"bad\.jsonl:3: cannot tokenise .*integer ids, got 'x'"),
    ('{"text": "1 900"}', r"bad\.jsonl:3: cannot tokenise .*id 900 is outside \[0, 100\)"),
    (b'{"text": "\xff\xfe"}', r"bad\.jsonl:3: malformed JSON"),
]


@pytest.mark.parametrize("bad,message", BAD_CASES)
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_is_an_error_naming_file_and_line(tmp_path, bad, message, workers):
    lines = [b'{"text": "1 2"}', b'{"text": "3"}', bad if isinstance(bad, bytes) else bad.encode()]
    lines += [b'{"text": "4 5"}'] * 40
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(PreprocessError, match=message + r".*--skip-bad-lines"):
        preprocess_jsonl(
            str(tmp_path / "bad.jsonl"),
            str(tmp_path / "o"),
            NullTokenizer(100),
            workers=workers,
            chunk_lines=2,
        )
    assert files_in(tmp_path) == ["bad.jsonl"]  # nothing written survives, not even temp files


def test_skip_bad_lines_counts_them_and_empty_documents(tmp_path):
    lines = ['{"text": "1 2"}', "", '{"text": "1 2"', '{"text": "   "}', "   ", '{"text": 7}']
    lines += ['{"text": "3"}', '{"text": "1 900"}', '{"text": ""}', '{"text": "4 5 6"}']
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    stats = preprocess_jsonl(
        src,
        str(tmp_path / "o"),
        NullTokenizer(100),
        append_eod=True,
        skip_bad_lines=True,
        chunk_lines=3,
    )
    assert _read_all(str(tmp_path / "o_text_document")) == [[1, 2, 100], [3, 100], [4, 5, 6, 100]]
    assert (stats.lines, stats.blank_lines, stats.bad_lines) == (10, 2, 3)
    assert stats.empty_documents["text"] == 2 and stats.documents["text"] == 3


def test_interrupted_run_leaves_nothing_and_keeps_an_old_output(tmp_path, monkeypatch):
    import megalite.data.preprocess as pp

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i % 90}"} for i in range(100)])
    preprocess_jsonl(src, str(tmp_path / "o"), NullTokenizer(100))  # a good earlier run
    before = {n: (tmp_path / n).read_bytes() for n in files_in(tmp_path) if n.startswith("o_")}
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = pp._absorb
    monkeypatch.setattr(pp, "_absorb", interrupt)
    with pytest.raises(KeyboardInterrupt):
        preprocess_jsonl(src, str(tmp_path / "o"), NullTokenizer(100), chunk_lines=10, workers=2)
    after = {n: (tmp_path / n).read_bytes() for n in files_in(tmp_path) if n.startswith("o_")}
    assert after == before  # the old pair, untouched, and no temporary files


def test_sigterm_leaves_no_dataset(tmp_path):
    lines = [json.dumps({"text": " ".join(["7"] * 200)})] * 200_000
    src = write_jsonl(tmp_path / "big.jsonl", lines)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        src,
        "--output-prefix",
        str(out / "p"),
        *"--tokenizer-type NullTokenizer --vocab-size 10 --workers 2".split(),
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, cwd=str(tmp_path))

    def writing() -> bool:  # tokens already in a temporary file: the run is under way
        names = files_in(out) if out.exists() else []
        return any(".tmp-" in n and (out / n).stat().st_size > 0 for n in names)

    deadline = time.monotonic() + HANG_GUARD_S
    while proc.poll() is None and not writing() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()  # not ended before the signal
    assert writing(), f"no tokens written in {HANG_GUARD_S} s"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_GUARD_S) != 0
    assert files_in(out) == [], files_in(out)


def test_missing_input_and_bad_workers(tmp_path):
    with pytest.raises(PreprocessError, match=r"--input .*nope\.jsonl: no such file"):
        preprocess_jsonl(str(tmp_path / "nope.jsonl"), str(tmp_path / "o"), NullTokenizer(5))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    with pytest.raises(PreprocessError, match="--workers must be >= 1, got 0"):
        preprocess_jsonl(src, str(tmp_path / "o"), NullTokenizer(5), workers=0)
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_cli_megatron_tokenizer_types(tmp_path, corpus_jsonl, sp_model):
    """GPT2BPETokenizer, Llama2Tokenizer (a bos first) and TikTokenizer through the CLI with 2
    workers (each gets a pickled tokenizer): the documents hold the tokenizer's ids, then eod."""
    from tests.data.bpe_files import (
        tiktoken_ranks,
        train_merges,
        write_gpt2_files,
        write_tiktoken_json,
    )
    from tools.preprocess_data import main

    texts = [json.loads(line)["text"] for line in open(corpus_jsonl, encoding="utf-8")]
    merges = train_merges(texts[:50], 60)
    vocab, merge_file = write_gpt2_files(tmp_path / "gpt2", merges)
    tik = write_tiktoken_json(tmp_path / "tik.json", tiktoken_ranks(merges))
    cases = {
        "GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merge_file],
        "Llama2Tokenizer": ["--tokenizer-model", sp_model],
        "TikTokenizer": [
            "--tokenizer-model",
            tik,
            *"--tiktoken-pattern v1 --tiktoken-num-special-tokens 8 --vocab-size 300".split(),
        ],
    }
    for kind, flags in cases.items():
        out = str(tmp_path / kind)
        argv = [
            "--input",
            corpus_jsonl,
            "--output-prefix",
            out,
            "--tokenizer-type",
            kind,
            *flags,
            *"--append-eod --workers 2 --chunk-lines 64".split(),
        ]
        assert main(argv) == 0, kind
        keys = {f[2:].replace("-", "_"): v for f, v in zip(flags[::2], flags[1::2])}
        for k in ("vocab_size", "tiktoken_num_special_tokens"):
            if k in keys:
                keys[k] = int(keys[k])
        tok = make_tokenizer(kind, **keys)
        want = [tok.tokenize(t) + [tok.eod] for t in texts]
        assert _read_all(out + "_text_document") == want, kind
        if kind == "Llama2Tokenizer":
            assert all(doc[0] == 1 and doc[-1] == 2 for doc in want)  # bos ... eos
