"""Blending: every dataset within one sample of its weight's share at every prefix of the blended
order (checked exhaustively, against weights the simple largest-deficit rule gets wrong), and the
blended datasets built from --data-path weights and prefixes."""

from __future__ import annotations

import numpy as np
import pytest

import megalite.data.blended_dataset as blended_module
from megalite.data.blended_dataset import BlendedDataset
from megalite.data.builders import build_datasets
from megalite.data.config import DataConfig
from megalite.data.index_builders import build_blending_index
from tests.data.helpers import write_dataset


def max_share_error(weights, dataset_index) -> float:
    """max over datasets d and prefixes n of |count_d(n) - w_d n| (plain cumulative counts)."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    n = np.arange(1, len(dataset_index) + 1)
    worst = 0.0
    for d in range(len(w)):
        counts = np.cumsum(np.asarray(dataset_index) == d)
        worst = max(worst, float(np.abs(counts - w[d] * n).max()))
    return worst


def largest_deficit_order(weights, size):
    """The simple rule (take the dataset furthest below its share) for comparison."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.zeros(len(w))
    out = []
    for i in range(size):
        d = int(np.argmax(w * (i + 1) - counts))
        counts[d] += 1
        out.append(d)
    return out


TOLERANCE = 1 + 1e-9  # "within one sample"; 1e-9 absorbs float rounding of w * n


def test_every_prefix_within_one_sample_of_its_share():
    rng = np.random.default_rng(0)
    for trial in range(60):
        k = int(rng.integers(2, 10))
        weights = (rng.random(k) ** rng.choice([1, 3, 6])).tolist()
        dataset_index, sample_index = build_blending_index(weights, 1500)
        assert max_share_error(weights, dataset_index) <= TOLERANCE, (trial, weights)
        for d in range(k):  # each dataset's samples are taken in order from its start
            assert sample_index[dataset_index == d].tolist() == list(
                range((dataset_index == d).sum())
            )


def test_hard_weights_where_the_largest_deficit_rule_drifts():
    weights = [0.8] + [0.04] * 5
    rng = np.random.default_rng(0)
    hard = None
    for _ in range(300):  # find weights where the simple rule is off by more than one sample
        k = int(rng.integers(4, 10))
        w = (rng.random(k) ** 6).tolist()
        if max_share_error(w, largest_deficit_order(w, 600)) > 1.05:
            hard = w
            break
    assert hard is not None  # the check below can tell the two rules apart
    for w in (weights, hard):
        assert max_share_error(w, build_blending_index(w, 600)[0]) <= TOLERANCE


def test_blending_is_exact_for_simple_weights():
    dataset_index, _ = build_blending_index([0.3, 0.7], 10)
    assert np.bincount(dataset_index).tolist() == [3, 7]
    assert build_blending_index([1, 1, 1], 6)[0].tolist() == [0, 1, 2, 0, 1, 2]


def _two_datasets(tmp_path):
    rng = np.random.default_rng(0)
    a = [rng.integers(0, 100, size=int(rng.integers(5, 40))) for _ in range(200)]
    b = [rng.integers(100, 200, size=int(rng.integers(5, 40))) for _ in range(100)]
    return write_dataset(tmp_path / "a", a), write_dataset(tmp_path / "b", b)


def test_data_path_weights_give_the_blend(tmp_path, monkeypatch):
    pa, pb = _two_datasets(tmp_path)
    cfg = DataConfig(
        data_path=["0.3", pa, "0.7", pb], vocab_size=200, seq_length=16, split="90,10,0"
    )
    train, valid, test = build_datasets(
        cfg, tokenizer=None, train_samples=500, valid_samples=40, test_samples=8
    )
    assert test is None and isinstance(train, BlendedDataset) and len(train) == 500
    source = []
    for i in range(500):
        s = train[i]
        assert s.shape == (17,) and ((s < 100).all() or (s >= 100).all())  # one dataset each
        source.append(int(s[0] >= 100))
    assert max_share_error([0.3, 0.7], source) <= TOLERANCE
    assert source == train.dataset_index.tolist()

    def no_rebuild(*args):
        raise AssertionError("the blending index should come from the cache")

    monkeypatch.setattr(blended_module, "build_blending_index", no_rebuild)
    again = build_datasets(cfg, tokenizer=None, train_samples=500, valid_samples=40, test_samples=8)
    assert [again[0][i].tolist() for i in range(20)] == [train[i].tolist() for i in range(20)]


def test_prefixes_without_weights_are_weighed_by_tokens(tmp_path):
    pa, pb = _two_datasets(tmp_path)
    cfg = DataConfig(data_path=[pa, pb], vocab_size=200, seq_length=16, split="1,0,0")
    train, _, _ = build_datasets(
        cfg, tokenizer=None, train_samples=300, valid_samples=0, test_samples=0
    )
    from megalite.data.indexed_dataset import IndexedDataset

    tokens = [IndexedDataset(p).num_tokens for p in (pa, pb)]
    assert train.weights == pytest.approx([t / sum(tokens) for t in tokens])


def test_per_split_paths_and_small_constituent_error(tmp_path):
    pa, pb = _two_datasets(tmp_path)
    cfg = DataConfig(
        train_data_path=[pa], valid_data_path=["1", pa, "1", pb], vocab_size=200, seq_length=16
    )
    train, valid, test = build_datasets(
        cfg, tokenizer=None, train_samples=64, valid_samples=32, test_samples=8
    )
    assert test is None and len(valid) == 32 and len(train) >= 64
    assert train.description["documents"] == [0, 200]  # the whole dataset for its split
    with pytest.raises(ValueError, match=r"blended dataset 1 .* must give \d+ samples but holds 2"):
        BlendedDataset([list(range(100)), [0, 1]], [0.5, 0.5], 100)
