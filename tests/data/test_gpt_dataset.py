"""GPTDataset: split by document, samples of seq_length + 1 tokens across documents and epochs,
per-epoch shuffled documents, shuffled samples; checked against plainly written slow references.
The index cache: reused when valid, rebuilt when stale or corrupt, never trusted blindly."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import megalite.data.gpt_dataset as gpt_module
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.index_builders import (
    build_document_index,
    build_gpt_indices,
    build_sample_index,
    compute_split_ranges,
    num_epochs_for,
)
from megalite.data.indexed_dataset import IndexedDataset
from tests.data.helpers import files_in, write_dataset


def slow_sample_starts(sizes, document_index, seq_length, num_samples):
    """Walk the stream token by token, noting (document position, offset) of every token."""
    where = []
    for pos, doc in enumerate(document_index):
        for offset in range(int(sizes[doc])):
            where.append((pos, offset))
    return [where[i * seq_length] for i in range(num_samples + 1)]


def slow_stream(ds: IndexedDataset, document_index) -> list[int]:
    out = []
    for doc in document_index:
        out.extend(ds[int(doc)].tolist())
    return out


def slow_num_epochs(tokens, seq_length, num_samples):
    epochs = 1
    while (epochs * tokens - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def test_split_ranges_follow_megatron_arithmetic():
    assert compute_split_ranges(1000, (0.969, 0.03, 0.001)) == [(0, 969), (969, 999), (999, 1000)]
    assert compute_split_ranges(10, (0.969, 0.03, 0.001)) == [(0, 10), (10, 10), (10, 10)]
    third = 1 / 3  # book-ends 0, 1/3, 2/3, 1 of 100 documents: 33.3 -> 33, 66.7 -> 67 (rounded)
    assert compute_split_ranges(100, (third, third, third)) == [(0, 33), (33, 67), (67, 100)]
    assert compute_split_ranges(73, (0.9, 0.05, 0.05)) == [(0, 66), (66, 69), (69, 73)]


@pytest.mark.parametrize("seq_length", [1, 3, 7, 16])
def test_sample_index_equals_slow_reference(seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 12, size=40).astype(np.int32)  # includes empty documents
    docs = np.arange(5, 35)
    tokens = int(sizes[docs].sum())
    for num_samples in (1, 10, 3 * tokens // seq_length):  # one to several epochs
        epochs = num_epochs_for(tokens, seq_length, num_samples)
        assert epochs == slow_num_epochs(tokens, seq_length, num_samples)
        doc_index = build_document_index(docs, epochs, rng)
        total = (epochs * tokens - 1) // seq_length
        got = build_sample_index(sizes, doc_index, seq_length=seq_length, num_samples=total)
        assert [tuple(r) for r in got.tolist()] == slow_sample_starts(
            sizes, doc_index, seq_length, total
        )


def test_document_index_is_a_permutation_per_epoch_and_seeded():
    docs = np.arange(10, 60)
    a = build_document_index(docs, 4, np.random.default_rng(3))
    for e in range(4):
        assert sorted(a[e * 50 : (e + 1) * 50].tolist()) == docs.tolist()
    assert (a[:50] != a[50:100]).any()  # epochs shuffled independently
    assert (a == build_document_index(docs, 4, np.random.default_rng(3))).all()
    assert (a != build_document_index(docs, 4, np.random.default_rng(4))).any()


def _unique_token_dataset(tmp_path, num_docs=60, seed=0):
    """Documents whose tokens are all distinct (token = its global position), so a sample's tokens
    tell exactly which stream positions it used."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 20, size=num_docs)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    docs = [np.arange(s, s + n) for s, n in zip(starts, sizes)]
    return IndexedDataset(write_dataset(tmp_path / "u", docs, dtype=np.int32))


@pytest.mark.parametrize("seq_length", [4, 9])
def test_dataset_samples_equal_reference_and_use_each_token_once(tmp_path, seq_length):
    ds = _unique_token_dataset(tmp_path)
    lo, hi = 10, 50
    gpt = GPTDataset(ds, (lo, hi), num_samples=None, seq_length=seq_length, seed=5, use_cache=False)
    stream = slow_stream(ds, gpt.document_index)
    n = len(gpt)
    assert n == (len(stream) - 1) // seq_length  # one epoch
    assert sorted(gpt.shuffle_index.tolist()) == list(range(n))
    inputs = []
    for i in range(n):
        j = int(gpt.shuffle_index[i])
        sample = gpt[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        assert sample.tolist() == stream[j * seq_length : j * seq_length + seq_length + 1]
        inputs.extend(sample[:-1].tolist())
    split_tokens = [t for d in range(lo, hi) for t in ds[d].tolist()]
    tail = stream[n * seq_length :]  # the documented tail: 1..seq_length tokens, never an input
    assert 1 <= len(tail) <= seq_length
    assert len(inputs) == len(set(inputs))  # no token is an input twice
    assert sorted(inputs + tail) == sorted(split_tokens)  # and every other one is, once


def test_indices_deterministic_for_a_seed_and_different_for_another():
    sizes = np.random.default_rng(0).integers(1, 50, size=200).astype(np.int32)
    docs = np.arange(200)
    a = build_gpt_indices(sizes, docs, seq_length=8, seed=1, num_samples=1000)
    b = build_gpt_indices(sizes, docs, seq_length=8, seed=1, num_samples=1000)
    c = build_gpt_indices(sizes, docs, seq_length=8, seed=2, num_samples=1000)
    for k in a:
        assert (a[k] == b[k]).all()
    assert (a["document_index"] != c["document_index"]).any()
    assert (a["shuffle_index"] != c["shuffle_index"]).any()


def test_separate_final_epoch_when_little_of_it_is_needed():
    sizes = np.full(100, 10, dtype=np.int32)  # 1000 tokens an epoch, 124 samples of 8
    docs = np.arange(100)
    per_epoch = (1000 - 1) // 8
    few = build_gpt_indices(sizes, docs, seq_length=8, seed=0, num_samples=per_epoch + 10)
    before_final = (1000 - 1) // 8
    head = few["shuffle_index"][:before_final]
    assert sorted(head.tolist()) == list(range(before_final))  # full epoch shuffled on its own
    many = build_gpt_indices(sizes, docs, seq_length=8, seed=0, num_samples=2 * per_epoch - 2)
    assert sorted(many["shuffle_index"].tolist()) == list(range(len(many["shuffle_index"])))
    assert not (np.sort(many["shuffle_index"][:before_final]) == np.arange(before_final)).all()


def test_asks_for_many_epochs_of_a_tiny_split(tmp_path):
    ds = IndexedDataset(write_dataset(tmp_path / "t", [[1, 2, 3], [4, 5]]))
    gpt = GPTDataset(ds, (0, 2), num_samples=100, seq_length=4, seed=0, use_cache=False)
    assert len(gpt) >= 100
    for i in range(100):
        s = gpt[i].tolist()  # every window of the doubled-up stream is valid
        assert len(s) == 5 and set(s) <= {1, 2, 3, 4, 5}


def test_errors_for_empty_split_and_too_long_seq(tmp_path):
    ds = IndexedDataset(write_dataset(tmp_path / "t", [[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"document range \[1, 1\) is empty"):
        GPTDataset(ds, (1, 1), num_samples=1, seq_length=2, seed=0, use_cache=False)
    with pytest.raises(ValueError, match=r"fewer than one sample of --seq-length 8"):
        GPTDataset(ds, (0, 1), num_samples=None, seq_length=8, seed=0, use_cache=False)


class _CountingBuilds:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = gpt_module.build_gpt_indices

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(gpt_module, "build_gpt_indices", counting)


def _make(ds, cache, **kw):
    args = dict(num_samples=50, seq_length=8, seed=3, cache_dir=str(cache))
    args.update(kw)
    return GPTDataset(ds, (0, len(ds)), **args)


def test_cache_is_reused_then_rebuilt_when_corrupt_or_stale(tmp_path, monkeypatch, caplog):
    ds = _unique_token_dataset(tmp_path, num_docs=30)
    cache = tmp_path / "cache"
    builds = _CountingBuilds(monkeypatch)
    first = _make(ds, cache)
    assert builds.calls == 1 and len(files_in(cache)) == 4
    again = _make(ds, cache)
    assert builds.calls == 1  # loaded, not rebuilt
    assert [again[i].tolist() for i in range(50)] == [first[i].tolist() for i in range(50)]
    for kw in ({"seq_length": 7}, {"seed": 4}, {"num_samples": 51}):
        _make(ds, cache, **kw)  # every setting that changes the indices changes the key
    assert builds.calls == 4 and len(files_in(cache)) == 16

    caplog.set_level(logging.WARNING)
    npy = next(
        p for p in cache.iterdir() if p.name.startswith(_key(cache, first)) and "sample_" in p.name
    )
    raw = bytearray(npy.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit of data
    npy.write_bytes(bytes(raw))
    rebuilt = _make(ds, cache)
    assert builds.calls == 5 and "checksum differs" in caplog.text
    assert (np.asarray(rebuilt.sample_index) == np.asarray(first.sample_index)).all()
    npy.write_bytes(npy.read_bytes()[:40])  # truncated
    _make(ds, cache)
    assert builds.calls == 6
    desc = next(cache.glob(_key(cache, first) + "*description.json"))
    desc.write_text("{not json")
    _make(ds, cache)
    assert builds.calls == 7
    _make(ds, cache)
    assert builds.calls == 7  # the rebuilt entry is valid again

    docs = [ds[i].tolist() for i in range(len(ds))]
    docs[0] = docs[0] + [999]  # the data changes under the same prefix: a stale cache
    write_dataset(tmp_path / "u", docs, dtype=np.int32)
    _make(IndexedDataset(str(tmp_path / "u")), cache)
    assert builds.calls == 8


def _key(cache, dataset) -> str:
    from megalite.data.index_cache import FORMAT_VERSION, description_key

    description = json.loads(json.dumps(dict(dataset.description, cache_format=FORMAT_VERSION)))
    return description_key(description)


def test_cache_location_and_read_only_ranks(tmp_path, monkeypatch):
    ds = _unique_token_dataset(tmp_path, num_docs=30)
    builds = _CountingBuilds(monkeypatch)
    GPTDataset(ds, (0, 30), num_samples=10, seq_length=8, seed=0)  # default: beside the data
    assert len(files_in(tmp_path / "cache" / "GPTDataset_indices")) == 4
    reader = _make(ds, tmp_path / "elsewhere", write_cache=False)  # nothing there: in memory
    assert builds.calls == 2 and not (tmp_path / "elsewhere").exists()
    assert len(reader) >= 50
