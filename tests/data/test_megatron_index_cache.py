"""Megatron-LM's own GPTDataset index files in ``--data-cache-path`` are reused when
their description is this dataset's (same prefix, split, seed, sequence length, sample count) and
the arrays check out; otherwise one line says why not and megalite builds its own.

The Megatron files are written here as Megatron writes them (``{md5}-GPTDataset-{split}-`` +
``description.txt`` (JSON, ``indent=4``), ``document_index.npy`` int32, ``sample_index.npy``,
``shuffle_index.npy``), holding an order megalite would not build (the shuffle reversed), so the
test sees which order the dataset uses.
"""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np

from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset
from tests.data.helpers import random_docs, write_dataset

SEQ, SEED, N = 8, 3, 20


def _megatron_files(cache, prefix, arrays, *, split="train", num_samples=N, seed=SEED):
    desc = {
        "class": "GPTDataset",
        "dataset_path": prefix,
        "num_samples": num_samples,
        "index_split": split,
        "random_seed": seed,
        "sequence_length": SEQ,
        "split": "100,0,0",
        "split_matrix": [[0, 1.0], None, None],
        "tokenizer": {},
        "add_extra_token_to_sequence": True,
        "reset_position_ids": False,
    }
    text = json.dumps(desc, indent=4)
    base = cache / f"{hashlib.md5(text.encode()).hexdigest()}-GPTDataset-{split}"
    (cache / f"{base.name}-description.txt").write_text(text)
    np.save(f"{base}-document_index.npy", arrays["document_index"].astype(np.int32))
    np.save(f"{base}-sample_index.npy", arrays["sample_index"].astype(np.int32))
    np.save(f"{base}-shuffle_index.npy", arrays["shuffle_index"])
    return base


def test_megatron_index_files_reused_when_they_describe_this_dataset(tmp_path, caplog):
    rng = np.random.default_rng(0)
    prefix = write_dataset(tmp_path / "d", random_docs(rng, 30, max_len=12, vocab=100, min_len=1))
    ds = IndexedDataset(prefix)
    own = GPTDataset(ds, (0, len(ds)), num_samples=N, seq_length=SEQ, seed=SEED, use_cache=False)
    theirs = {
        "document_index": own.document_index,
        "sample_index": own.sample_index,
        "shuffle_index": np.ascontiguousarray(own.shuffle_index[::-1]),
    }
    cache = tmp_path / "cache"
    cache.mkdir()
    _megatron_files(cache, prefix, theirs)
    caplog.set_level(logging.INFO, logger="megalite")
    got = GPTDataset(
        ds, (0, len(ds)), num_samples=N, seq_length=SEQ, seed=SEED, cache_dir=str(cache)
    )
    assert "using Megatron-LM's index files" in caplog.text
    assert np.array_equal(got.shuffle_index, theirs["shuffle_index"])
    for i in (0, 5, len(got) - 1):  # sample i of Megatron's order is megalite's sample n-1-i
        assert np.array_equal(got[i], own[len(own) - 1 - i])
    # another sample count: not this run's entry; one line says which setting differs
    caplog.clear()
    other = GPTDataset(
        ds, (0, len(ds)), num_samples=N + 7, seq_length=SEQ, seed=SEED, cache_dir=str(cache)
    )
    lines = [r.getMessage() for r in caplog.records if "not reused" in r.getMessage()]
    assert len(lines) == 1 and "num_samples 20 differs from this run's 27" in lines[0], lines
    assert "\n" not in lines[0]
    assert not np.array_equal(other.shuffle_index[:N], theirs["shuffle_index"])
    # a corrupt entry (document index outside the split): not trusted
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = dict(theirs, document_index=theirs["document_index"] + 1)
    _megatron_files(bad, prefix, broken)
    caplog.clear()
    fallback = GPTDataset(
        ds, (0, len(ds)), num_samples=N, seq_length=SEQ, seed=SEED, cache_dir=str(bad)
    )
    assert "does not span this split's documents" in caplog.text
    assert np.array_equal(fallback.shuffle_index, own.shuffle_index)
