"""The DP-aware sampler and the loaders: Megatron's micro-batch order for every DP size, exact
resume from consumed samples, cycling validation, the batch dict, mock data, the cache barrier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megalite.data.gpt_dataset as gpt_module
from megalite.data.builders import build_data_loaders, train_valid_test_num_samples
from megalite.data.config import DataConfig
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data.null_tokenizer import NullTokenizer
from megalite.data.samplers import GPTBatchCollator, MicroBatchSampler
from tests.data.helpers import random_docs, write_dataset


def reference_micro_batches(total, gbs, mbs, dp_rank, dp_size):
    """Plainly: global batch g, micro-step m, rank r gets gbs*g + m*mbs*dp + r*mbs + [0, mbs)."""
    out = []
    for g in range(total // gbs):
        for m in range(gbs // (mbs * dp_size)):
            first = g * gbs + m * mbs * dp_size + dp_rank * mbs
            out.append(list(range(first, first + mbs)))
    return out


@pytest.mark.parametrize("dp_size,mbs", [(1, 1), (1, 4), (2, 2), (4, 1), (4, 2)])
def test_sampler_matches_megatron_order_for_every_dp_size(dp_size, mbs):
    gbs, total = 8, 61  # the last incomplete global batch is dropped
    per_rank = []
    for r in range(dp_size):
        s = MicroBatchSampler(
            total_samples=total,
            consumed_samples=0,
            micro_batch_size=mbs,
            global_batch_size=gbs,
            dp_rank=r,
            dp_size=dp_size,
        )
        got = list(s)
        assert got == reference_micro_batches(total, gbs, mbs, r, dp_size) and len(s) == len(got)
        per_rank.append(got)
    merged = [i for step in zip(*per_rank) for batch in step for i in batch]
    assert merged == list(range(56))  # any DP size consumes the same global batches in order


def test_sampler_resume_and_cycle():
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2)
    full = list(MicroBatchSampler(total_samples=64, consumed_samples=0, **kw))
    assert list(MicroBatchSampler(total_samples=64, consumed_samples=24, **kw)) == full[6:]
    cyc = iter(MicroBatchSampler(total_samples=20, consumed_samples=8, cyclic=True, **kw))
    got = [next(cyc) for _ in range(6)]  # cycle of 16 (two global batches), from sample 8
    assert got == [[10, 11], [14, 15], [2, 3], [6, 7], [10, 11], [14, 15]]
    with pytest.raises(ValueError, match=r"consumed samples 6 is not a non-negative multiple .* 4"):
        MicroBatchSampler(total_samples=64, consumed_samples=6, **kw)
    with pytest.raises(ValueError, match=r"--global-batch-size 6 is not a multiple .* = 4"):
        MicroBatchSampler(
            total_samples=64,
            consumed_samples=0,
            micro_batch_size=2,
            global_batch_size=6,
            dp_rank=0,
            dp_size=2,
        )


def test_collator_builds_the_batch_dict():
    samples = [np.array([5, 9, 7, 9, 1]), np.array([9, 2, 3, 4, 9])]
    for mask in (False, True):
        b = GPTBatchCollator(eod=9, eod_mask_loss=mask)(samples)
        assert b["tokens"].tolist() == [[5, 9, 7, 9], [9, 2, 3, 4]]
        assert b["labels"].tolist() == [[9, 7, 9, 1], [2, 3, 4, 9]]
        assert b["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
        assert b["tokens"].dtype == b["labels"].dtype == b["position_ids"].dtype == torch.int64
        assert b["loss_mask"].dtype == torch.float32
        want = [[1, 0, 1, 0], [0, 1, 1, 1]] if mask else [[1, 1, 1, 1]] * 2
        assert b["loss_mask"].tolist() == want


def test_mock_data_is_deterministic_learnable_and_free_of_eod():
    ds = MockGPTDataset(num_samples=50, seq_length=32, vocab_size=101, eod=100, seed=7)
    again = MockGPTDataset(num_samples=50, seq_length=32, vocab_size=101, eod=100, seed=7)
    other = MockGPTDataset(num_samples=50, seq_length=32, vocab_size=101, eod=100, seed=8)
    assert all((ds[i] == again[i]).all() for i in range(50))
    assert any((ds[i] != other[i]).any() for i in range(50))
    for i in range(50):
        s = ds[i]
        assert s.shape == (33,) and s.min() >= 0 and s.max() < 100
        assert ((s[2:] - 2 * s[1:-1] + s[:-2]) % 100 == 0).all()  # fixed by the last two tokens
    sp_like = MockGPTDataset(num_samples=20, seq_length=64, vocab_size=50, eod=2, seed=0)
    assert all(2 not in sp_like[i].tolist() and sp_like[i].max() < 50 for i in range(20))


def _dataset(tmp_path):
    docs = random_docs(np.random.default_rng(0), 300, max_len=40, vocab=1000)
    return write_dataset(tmp_path / "d", docs)


def _loaders(cfg, **kw):
    args = dict(
        seq_length=16,
        seed=1234,
        tokenizer=NullTokenizer(1000),
        micro_batch_size=2,
        global_batch_size=8,
        dp_rank=0,
        dp_size=2,
        train_samples=96,
        valid_samples=24,
        test_samples=8,
    )
    args.update(kw)
    return build_data_loaders(cfg, **args)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


@pytest.mark.parametrize("blend", [False, True])
def test_resume_from_consumed_samples_yields_the_same_batches(tmp_path, blend):
    prefix = _dataset(tmp_path)
    path = ["0.5", prefix, "0.5", prefix] if blend else [prefix]
    cfg = DataConfig(data_path=path, vocab_size=1000, split="80,20,0")
    for rank in (0, 1):
        train, valid, test = _loaders(cfg, dp_rank=rank)
        assert test is None
        whole = list(train)
        assert len(whole) == 96 // 4
        b = whole[0]
        assert {k: (tuple(v.shape), v.dtype) for k, v in b.items()} == {
            "tokens": ((2, 16), torch.int64),
            "labels": ((2, 16), torch.int64),
            "loss_mask": ((2, 16), torch.float32),
            "position_ids": ((2, 16), torch.int64),
        }
        resumed, _, _ = _loaders(cfg, dp_rank=rank, consumed_train_samples=40)
        assert _same(list(resumed), whole[10:])
        v_all = _take(valid, 9)  # 24 samples = 3 global batches = 6 micro-steps; then again
        assert _same(v_all[6:], v_all[:3])
        _, v_resumed, _ = _loaders(cfg, dp_rank=rank, consumed_valid_samples=16)
        assert _same(_take(v_resumed, 4), v_all[4:8])


def test_dp_ranks_together_see_the_dp1_stream(tmp_path):
    cfg = DataConfig(data_path=[_dataset(tmp_path)], vocab_size=1000, split="1,0,0")
    single = list(_loaders(cfg, dp_size=1, micro_batch_size=4)[0])
    ranks = [list(_loaders(cfg, dp_size=2, dp_rank=r)[0]) for r in (0, 1)]
    for step, (a, b) in enumerate(zip(*ranks)):
        assert torch.equal(torch.cat([a["tokens"], b["tokens"]]), single[step]["tokens"])


def test_workers_give_the_same_batches(tmp_path):
    cfg = DataConfig(data_path=[_dataset(tmp_path)], vocab_size=1000, split="1,0,0")
    plain = list(_loaders(cfg)[0])
    cfg.num_workers = 2
    assert _same(list(_loaders(cfg)[0]), plain)


def test_mock_loaders_share_the_path(tmp_path):
    cfg = DataConfig(mock_data=True, vocab_size=100)
    train, valid, test = _loaders(cfg, seq_length=8, seed=3, tokenizer=NullTokenizer(100))
    first = next(train)
    ds = MockGPTDataset(num_samples=96, seq_length=8, vocab_size=101, eod=100, seed=3)
    assert first["tokens"].tolist() == [ds[0][:-1].tolist(), ds[1][:-1].tolist()]
    assert next(valid)["tokens"].shape == (2, 8) and next(test)["tokens"].shape == (2, 8)


def test_cache_builders_then_barrier_then_readers(tmp_path, monkeypatch):
    cfg = DataConfig(
        data_path=[_dataset(tmp_path)],
        vocab_size=1000,
        split="8,1,1",
        data_cache_path=str(tmp_path / "cache"),
    )
    events = []
    real = gpt_module.build_gpt_indices

    def counting(*args, **kwargs):
        events.append("build")
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "build_gpt_indices", counting)
    builder = _loaders(cfg, build_cache=True, barrier=lambda: events.append("barrier"))
    assert events == ["build", "build", "build", "barrier"]  # train, valid, test; then the barrier
    events.clear()
    reader = _loaders(cfg, build_cache=False, barrier=lambda: events.append("barrier"))
    assert events == ["barrier"]  # waits, then loads every index from the cache
    assert _same(_take(reader[0], 3), _take(builder[0], 3))


def test_sample_counts_follow_megatron():
    assert train_valid_test_num_samples(
        train_iters=1000, global_batch_size=8, eval_interval=100, eval_iters=10
    ) == (8000, 11 * 10 * 8, 80)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_batches_are_pinned_for_cuda(tmp_path):
    cfg = DataConfig(mock_data=True, vocab_size=100, num_workers=2)
    loaders = _loaders(cfg, seq_length=8, tokenizer=NullTokenizer(100), device=torch.device("cuda"))
    batch = next(loaders[0])
    assert all(v.is_pinned() for v in batch.values())


def test_build_data_cache_tool_prepares_every_index(tmp_path, monkeypatch):
    from tools.build_data_cache import main

    prefix = _dataset(tmp_path)
    cache = str(tmp_path / "cache")
    argv = [
        "--data-path",
        "0.4",
        prefix,
        "0.6",
        prefix,
        *"--split 8,1,1 --seq-length 16 --seed 9 --data-cache-path".split(),
        cache,
        *"--train-iters 12 --global-batch-size 8 --eval-interval 6 --eval-iters 1 --lr 0.1".split(),
    ]
    assert main(argv) == 0

    def no_build(*args, **kwargs):
        raise AssertionError("the job should find every index in the cache")

    import megalite.data.blended_dataset as blended_module

    monkeypatch.setattr(gpt_module, "build_gpt_indices", no_build)
    monkeypatch.setattr(blended_module, "build_blending_index", no_build)
    cfg = DataConfig(
        data_path=["0.4", prefix, "0.6", prefix],
        split="8,1,1",
        data_cache_path=cache,
        vocab_size=1000,
    )
    train, valid, test = train_valid_test_num_samples(
        train_iters=12, global_batch_size=8, eval_interval=6, eval_iters=1
    )
    loaders = _loaders(
        cfg, seed=9, train_samples=train, valid_samples=valid, test_samples=test, build_cache=False
    )
    assert all(it is not None for it in loaders) and len(list(loaders[0])) == 12 * 8 // 4
