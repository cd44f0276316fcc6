"""The .bin/.idx format: Megatron's own files read exactly and re-written byte for byte; every
malformed pair refused with the file and the fault named; merging shards; atomic writes."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    merge_datasets,
    optimal_dtype,
)
from tests.data.helpers import files_in, random_docs, shared_fixture, write_dataset


@pytest.mark.parametrize("name,dtype", [("tiny", np.uint16), ("tiny_int32", np.int32)])
def test_megatron_fixture_reads_and_rewrites_byte_identical(tmp_path, name, dtype):
    fx = shared_fixture("megatron_tiny")
    meta = json.loads((fx / "documents.json").read_text())
    docs = meta["documents"]
    ds = IndexedDataset(str(fx / name))
    assert ds.dtype == np.dtype(dtype) and meta["files"][name]["dtype"] == str(np.dtype(dtype))
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.get(2, 1, 3).tolist() == docs[2][1:4]
    out = write_dataset(tmp_path / "out", docs, dtype=dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (fx / f"{name}{ext}").read_bytes(), ext
    assert files_in(tmp_path) == ["out.bin", "out.idx"]  # no temporary or side files left
    assert IndexedDataset(out).num_tokens == sum(len(d) for d in docs)


def test_round_trip_multi_sequence_documents_and_views(tmp_path):
    rng = np.random.default_rng(0)
    seqs = random_docs(rng, 50, max_len=30, vocab=70000)
    ends = [0]
    with IndexedDatasetBuilder(str(tmp_path / "d"), dtype=np.int32) as b:
        for i, s in enumerate(seqs):
            b.add_item(s)
            if i % 3 == 2 or i == len(seqs) - 1:  # documents of 3 sequences
                b.end_document()
                ends.append(i + 1)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 50 and ds.num_documents == len(ends) - 1
    assert ds.document_indices.tolist() == ends
    for i, s in enumerate(seqs):
        got = ds[i]
        assert got.dtype == np.int32 and got.tolist() == s.tolist()
        if len(s):
            assert not got.flags.owndata and not got.flags.writeable  # a view into the map
    lengths = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 4
    assert ds.sequence_pointers.tolist() == pointers.tolist()
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers re-map the files
    assert clone[7].tolist() == seqs[7].tolist()


def test_add_documents_batch_equals_one_by_one(tmp_path):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 40, max_len=20, vocab=1000, min_len=1)
    write_dataset(tmp_path / "a", docs)
    with IndexedDatasetBuilder(str(tmp_path / "b"), dtype=np.uint16) as b:
        b.add_documents(np.concatenate(docs[:25]), [len(d) for d in docs[:25]])
        b.add_documents(np.concatenate(docs[25:]), [len(d) for d in docs[25:]])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_optimal_dtype_boundary():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32


def test_builder_refuses_ids_that_do_not_fit(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"token ids span \[0, 70000\].*uint16"):
        b.add_document([0, 70000])
    b.abort()
    assert files_in(tmp_path) == []


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x"), dtype=np.uint16) as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert files_in(tmp_path) == []


def test_merge_equals_writing_everything_at_once(tmp_path):
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 30, max_len=12, vocab=500)
    write_dataset(tmp_path / "shard0", docs[:10])
    write_dataset(tmp_path / "shard1", docs[10:11])
    write_dataset(tmp_path / "shard2", docs[11:])
    write_dataset(tmp_path / "whole", docs)
    shards = [str(tmp_path / f"shard{i}") for i in range(3)]
    merged = merge_datasets(shards, str(tmp_path / "merged"))
    assert len(merged) == 30
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()


def test_merge_tool_folder_and_dtype_mismatch(tmp_path, capsys):
    from tools.merge_datasets import main

    (tmp_path / "shards").mkdir()
    write_dataset(tmp_path / "shards" / "b", [[3, 4]])
    write_dataset(tmp_path / "shards" / "a", [[1, 2]])
    assert main(["--input", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "m")]) == 0
    assert [x.tolist() for x in IndexedDataset(str(tmp_path / "m"))] == [[1, 2], [3, 4]]
    write_dataset(tmp_path / "wide", [[5]], dtype=np.int32)
    rc = main(["--input", str(tmp_path / "m"), str(tmp_path / "wide"), "--output-prefix", "z"])
    assert rc == 1
    assert "wide.idx holds int32 tokens but the output is uint16" in capsys.readouterr().err
    assert not any(n.startswith("z") for n in files_in(tmp_path))


def _corrupt(tmp_path, edit):
    prefix = write_dataset(tmp_path / "c", [[1, 2, 3], [4, 5]])
    idx = bytearray((tmp_path / "c.idx").read_bytes())
    binary = bytearray((tmp_path / "c.bin").read_bytes())
    idx, binary = edit(idx, binary)
    (tmp_path / "c.idx").write_bytes(bytes(idx))
    (tmp_path / "c.bin").write_bytes(bytes(binary))
    return prefix


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda i, b: (b"XXIDIDX\x00\x00" + i[9:], b), r"c\.idx: wrong magic"),
        (
            lambda i, b: (i[:9] + struct.pack("<Q", 2) + i[17:], b),
            r"c\.idx: unsupported.*version 2",
        ),
        (lambda i, b: (i[:17] + b"\x09" + i[18:], b), r"c\.idx: unknown dtype code 9"),
        (lambda i, b: (i[:20], b), r"c\.idx: truncated index: 20 bytes, the header alone needs 34"),
        (lambda i, b: (i[:-8], b), r"c\.idx: truncated index: .*2 sequences and 3 document"),
        (lambda i, b: (i + b"\x00" * 5, b), r"c\.idx: 5 unexpected bytes after"),
        (lambda i, b: (i, b[:-2]), r"c\.bin: 8 bytes, but its index .*c\.idx describes 10"),
        (lambda i, b: (i, b + b"\x00\x00"), r"c\.bin: 12 bytes, but its index"),
    ],
)
def test_malformed_pairs_are_refused_naming_the_file(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(prefix)


def test_missing_file_is_named(tmp_path):
    write_dataset(tmp_path / "c", [[1]])
    (tmp_path / "c.bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: no such file"):
        IndexedDataset(str(tmp_path / "c"))
