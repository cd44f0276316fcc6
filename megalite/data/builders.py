"""From a DataConfig to the train/valid/test datasets and this DP rank's loaders.

Datasets: ``--mock-data`` gives MockGPTDataset; ``--data-path P`` gives one GPTDataset per split;
``--data-path w1 P1 w2 P2 ...`` (or several prefixes without weights, weighed by their token counts)
gives a BlendedDataset per split over each prefix's split; ``--train-data-path`` etc. use whole
datasets for one split each. Caching: ranks with ``build_cache`` build (or verify) every index
cache first, then all ranks meet at ``barrier``, then the other ranks load. Pass build_cache=True on
one rank per node when ``--data-cache-path`` is node-local (or not given and the data folder is
node-local), on global rank 0 alone when it is shared. Without ``--data-cache-path`` the caches
live beside the data, or in a per-user folder when the data folder is read-only (``cache_dirs``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch

from megalite.data import cache_dirs
from megalite.data.blended_dataset import BlendedDataset, default_blend_cache_dir
from megalite.data.config import DataConfig, parse_blend, parse_split
from megalite.data.gpt_dataset import SPLIT_NAMES, GPTDataset
from megalite.data.index_builders import compute_split_ranges
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data.samplers import MicroBatchSampler, make_loader
from megalite.data.vocab_check import check_token_ids
from megalite.errors import DataError

logger = logging.getLogger(__name__)


def train_valid_test_num_samples(
    *, train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """Megatron's sample counts: train = iters x gbs; valid = (iters // eval_interval + 1) x
    eval_iters x gbs (every evaluation plus the final one); test = eval_iters x gbs."""
    evals = train_iters // eval_interval + 1 if eval_interval > 0 else 1
    return (
        train_iters * global_batch_size,
        evals * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


def build_datasets(
    cfg: DataConfig,
    *,
    seq_length: int,
    seed: int,
    tokenizer,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    write_cache: bool = True,
) -> tuple:
    """(train, valid, test) datasets of ``seq_length``-token samples, shuffled from ``seed``
    (None where a split is empty or asks for 0 samples)."""
    cfg.validate()
    wanted = (train_samples, valid_samples, test_samples)
    if cfg.mock_data:
        return tuple(
            MockGPTDataset(
                num_samples=n,
                seq_length=seq_length,
                vocab_size=tokenizer.vocab_size,
                eod=tokenizer.eod,
                seed=seed,
                split_name=name,
            )
            if n > 0
            else None
            for name, n in zip(SPLIT_NAMES, wanted)
        )
    common = {"cfg": cfg, "seq_length": seq_length, "seed": seed, "write_cache": write_cache}
    if cfg.data_path:
        split = parse_split(cfg.split)
        prefixes, weights = parse_blend(cfg.data_path, flag="--data-path")
        return tuple(
            _build_split(prefixes, weights, split_index=i, split=split, num_samples=n, **common)
            if n > 0 and split[i] > 0
            else None
            for i, n in enumerate(wanted)
        )
    out = []
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    paths = (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path)
    for i, (flag, p, n) in enumerate(zip(flags, paths, wanted)):
        if not p or n <= 0:
            out.append(None)
            continue
        prefixes, weights = parse_blend(p, flag=flag)
        whole = tuple(1.0 if j == i else 0.0 for j in range(3))
        out.append(
            _build_split(prefixes, weights, split_index=i, split=whole, num_samples=n, **common)
        )
    return tuple(out)


def _build_split(
    prefixes: list[str],
    weights: list[float] | None,
    *,
    split_index: int,
    split: tuple[float, float, float],
    num_samples: int,
    cfg: DataConfig,
    seq_length: int,
    seed: int,
    write_cache: bool,
):
    name = SPLIT_NAMES[split_index]
    indexed = [IndexedDataset(p) for p in prefixes]
    if weights is None:
        weights = [float(ds.num_tokens) for ds in indexed]
    total_w = sum(weights)
    parts = []
    for ds, w in zip(indexed, weights):
        lo, hi = compute_split_ranges(len(ds), split)[split_index]
        split_text = cfg.split if cfg.data_path else None  # None: a whole --{split}-data-path
        if _split_problem(
            ds, lo, hi, split_index=split_index, split=split_text, blend=len(indexed)
        ):
            return None  # an empty valid/test split of one dataset: no such data (warned)
        n = num_samples if len(indexed) == 1 else math.ceil(w / total_w * num_samples) + 1
        parts.append(
            GPTDataset(
                ds,
                (lo, hi),
                num_samples=n,
                seq_length=seq_length,
                seed=seed,
                split_name=name,
                cache_dir=cfg.data_cache_path,
                write_cache=write_cache,
            )
        )
    if len(parts) == 1:
        return parts[0]
    beside = default_blend_cache_dir(prefixes[0])
    cache = cache_dirs.resolve(cfg.data_cache_path, beside=beside, writer=write_cache)
    return BlendedDataset(parts, weights, num_samples, cache=cache, write_cache=write_cache)


def _split_problem(
    ds: IndexedDataset, lo: int, hi: int, *, split_index: int, split: str | None, blend: int
) -> bool:
    """Whether documents ``[lo, hi)`` of ``ds`` give the split no tokens. That is a ``DataError``
    for the train split, in a blend, or for a whole dataset (``--valid-data-path``, ``split``
    None); a warning (and True) for a valid/test split of one ``--data-path`` dataset."""
    if hi > lo and int(ds.sequence_lengths[lo:hi].sum(dtype=np.int64)) > 0:
        return False
    name = SPLIT_NAMES[split_index]
    docs = f"documents [{lo}, {hi}) hold no tokens" if hi > lo else "no documents"
    whole = split is None
    flag = f"--{name}-data-path" if whole else "--data-path"
    if len(ds) == 0 or int(ds.sequence_lengths.sum(dtype=np.int64)) == 0:
        problem = f"{flag} {ds.prefix}: the dataset holds no tokens ({len(ds)} documents)"
        fix = "give a dataset with text (preprocessing an empty input writes an empty one)"
    elif whole:
        problem = f"{flag} {ds.prefix}: {docs}"
        fix = "give a dataset with tokens"
    else:
        problem = f"--split {split} gives the {name} split of {ds.prefix} {docs} (of {len(ds)})"
        fix = "use more data or change --split"
    if split_index == 0 or blend > 1 or whole:
        if split_index and not whole:
            fix = "blend only datasets large enough for every split, or change --split"
        raise DataError(
            f"{problem}; nothing to {'train' if split_index == 0 else 'evaluate'} on; {fix}"
        )
    logger.warning("%s; no %s evaluation in this run (%s)", problem, name, fix)
    return True


def check_data(
    cfg: DataConfig,
    *,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    scan: bool = True,
    wait_s: float = 600.0,
) -> None:
    """The start-up checks of what ``build_datasets`` will read, from the flags and the files only
    (no process group): every index opens (headers, sizes: ``IndexedDatasetError``), every split
    the run reads has tokens (``DataError``; an empty valid/test split of one dataset warns), and
    with ``vocab_size`` every token id fits it (``vocab_check``; the id range is cached with the
    index caches). ``scan``: this rank reads each ``.bin`` whose range is not cached yet and
    caches it; pass it on local rank 0 alone, the node's other ranks wait up to ``wait_s`` seconds
    for those entries (``vocab_check.token_range``)."""
    if cfg.mock_data:
        return
    wanted = (train_samples, valid_samples, test_samples)
    jobs = []  # (flag, prefixes, split fractions or None for a whole dataset, split index)
    if cfg.data_path:
        split = parse_split(cfg.split)
        prefixes, _ = parse_blend(cfg.data_path, flag="--data-path")
        if train_samples > 0 and split[0] <= 0:
            raise DataError(
                f"--split {cfg.split} gives the train split no share of --data-path; give it one "
                "(e.g. --split 969,30,1)"
            )
        jobs += [
            ("--data-path", prefixes, split, i)
            for i, n in enumerate(wanted)
            if n > 0 and split[i] > 0
        ]
    else:
        paths = (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path)
        for i, (p, n) in enumerate(zip(paths, wanted)):
            if p and n > 0:
                flag = f"--{SPLIT_NAMES[i]}-data-path"
                jobs.append((flag, parse_blend(p, flag=flag)[0], None, i))
    opened: dict[str, tuple[str, IndexedDataset]] = {}
    for flag, prefixes, split, i in jobs:
        for p in prefixes:
            if p not in opened:
                opened[p] = (flag, IndexedDataset(p))
            ds = opened[p][1]
            fractions = split or tuple(1.0 if j == i else 0.0 for j in range(3))
            lo, hi = compute_split_ranges(len(ds), fractions)[i]
            split_text = None if split is None else cfg.split
            _split_problem(ds, lo, hi, split_index=i, split=split_text, blend=len(prefixes))
    if vocab_size is None:
        return
    for flag, ds in opened.values():
        check_token_ids(
            ds,
            vocab_size=vocab_size,
            padded_vocab_size=padded_vocab_size or vocab_size,
            flag=flag,
            cache_dir=cfg.data_cache_path,
            scan=scan,
            wait_s=wait_s,
        )


def build_data_loaders(
    cfg: DataConfig,
    *,
    seq_length: int,
    seed: int,
    tokenizer,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    device: torch.device | None = None,
    build_cache: bool = True,
    barrier: Callable[[], None] | None = None,
    train_global_batch_size: int | None = None,
) -> tuple[Iterator | None, Iterator | None, Iterator | None]:
    """This DP rank's (train, valid, test) micro-batch iterators (None for an empty split).

    Each yields dicts of ``tokens``/``labels``/``position_ids`` int64 and ``loss_mask`` float32,
    all ``[micro_batch_size, seq_length]``, on CPU (pinned when ``device`` is CUDA). Train runs once
    over ``train_samples`` from ``consumed_train_samples``; valid and test cycle over theirs (valid
    from ``consumed_valid_samples``). ``barrier`` (if given) is called exactly once on every rank,
    between the cache builders' and the other ranks' dataset construction.
    ``train_global_batch_size``: the train sampler's batch when it differs from
    ``global_batch_size``: micro x DP under a batch-size ramp (``--rampup-batch-size``), where the
    iterations take the micro-batches one after another, as Megatron's sampler gives them,
    whatever the batch.
    """
    datasets = None
    kwargs = dict(
        seq_length=seq_length,
        seed=seed,
        tokenizer=tokenizer,
        train_samples=train_samples,
        valid_samples=valid_samples,
        test_samples=test_samples,
    )
    if build_cache:
        datasets = build_datasets(cfg, write_cache=True, **kwargs)
    if barrier is not None:
        barrier()
    if not build_cache:
        datasets = build_datasets(cfg, write_cache=False, **kwargs)
    consumed = (consumed_train_samples, consumed_valid_samples, 0)
    wanted = (train_samples, valid_samples, test_samples)
    train_batch = train_global_batch_size or global_batch_size
    batch_sizes = (train_batch, global_batch_size, global_batch_size)
    loaders = []
    for i, ds in enumerate(datasets):
        if ds is None:
            loaders.append(None)
            continue
        sampler = MicroBatchSampler(
            total_samples=min(wanted[i], len(ds)),
            consumed_samples=consumed[i],
            micro_batch_size=micro_batch_size,
            global_batch_size=batch_sizes[i],
            dp_rank=dp_rank,
            dp_size=dp_size,
            cyclic=i > 0,
        )
        loaders.append(
            make_loader(
                ds,
                sampler,
                eod=tokenizer.eod,
                eod_mask_loss=cfg.eod_mask_loss,
                num_workers=cfg.num_workers,
                device=device,
                reset_position_ids=cfg.reset_position_ids,
                reset_attention_mask=cfg.reset_attention_mask,
            )
        )
    return tuple(loaders)
