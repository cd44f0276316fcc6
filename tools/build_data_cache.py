r"""Build the dataset index caches ahead of a big job, offline, on one machine.

Usage (the same data flags as pretrain_gpt.py; other training flags are ignored with a note):
    python tools/build_data_cache.py --data-path 0.3 data/a_text_document 0.7 data/b_text_document \
        --split 969,30,1 --seq-length 2048 --seed 1234 --data-cache-path /shared/cache \
        --train-iters 100000 --global-batch-size 512 --eval-interval 1000 --eval-iters 10

Sample counts follow Megatron (and megalite.data.builders.train_valid_test_num_samples):
train = iters x gbs, valid = (iters // eval-interval + 1) x eval-iters x gbs, test = eval-iters x
gbs; --train-samples replaces iters x gbs. The job then finds every cache valid and only loads it;
the range of token ids of each .bin (the start-up vocabulary check) is cached too.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megalite.data.builders import build_datasets, check_data, train_valid_test_num_samples
from megalite.data.config import DataConfig, parse_blend
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.vocab_check import token_range
from megalite.errors import ArgumentParser, UsageError, check_writable_dir, run_main
from megalite.models.config import GPTConfig
from megalite.training.config import TrainingConfig


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-path", nargs="+", default=None)
    data, training = DataConfig(), TrainingConfig()  # the defaults of pretrain_gpt.py
    p.add_argument("--split", default=data.split)
    p.add_argument("--train-data-path", nargs="+", default=None)
    p.add_argument("--valid-data-path", nargs="+", default=None)
    p.add_argument("--test-data-path", nargs="+", default=None)
    p.add_argument("--data-cache-path", default=None)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=GPTConfig.seed)
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--eval-interval", type=int, default=training.eval_interval)
    p.add_argument("--eval-iters", type=int, default=training.eval_iters)
    args, ignored = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if ignored:
        logging.info("ignoring flags that do not change the data caches: %s", " ".join(ignored))
    if (args.train_iters is None) == (args.train_samples is None):
        raise UsageError("give exactly one of --train-iters and --train-samples")
    iters = args.train_iters
    if iters is None:
        iters = -(-args.train_samples // args.global_batch_size)
    train, valid, test = train_valid_test_num_samples(
        train_iters=iters,
        global_batch_size=args.global_batch_size,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
    )
    if args.train_samples is not None:
        train = args.train_samples
    cfg = DataConfig(
        data_path=args.data_path,
        split=args.split,
        train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path,
        data_cache_path=args.data_cache_path,
        vocab_size=1,  # the caches do not depend on the tokenizer
    )
    try:
        cfg.validate()
    except ValueError as e:  # the data flags, each named in the message
        raise UsageError(str(e)) from None
    if args.seq_length < 1:
        raise UsageError(f"--seq-length must be an integer >= 1, got {args.seq_length}")
    if args.seed < 0:
        raise UsageError(f"--seed must be an integer >= 0, got {args.seed}")
    if args.data_cache_path:
        check_writable_dir(args.data_cache_path, flag="--data-cache-path", what="index caches")
    samples = {"train_samples": train, "valid_samples": valid, "test_samples": test}
    check_data(cfg, **samples)  # the indexes open and the splits read have tokens
    datasets = build_datasets(
        cfg, seq_length=args.seq_length, seed=args.seed, tokenizer=None, **samples
    )
    for name, ds in zip(("train", "valid", "test"), datasets):
        logging.info("%s: %s", name, "none" if ds is None else f"{len(ds)} samples cached")
    for prefix in _prefixes(cfg):  # the start-up vocabulary check then only reads them
        found = token_range(IndexedDataset(prefix), cache_dir=args.data_cache_path)
        logging.info("%s: token ids %s cached", prefix, "none" if found is None else list(found))
    return 0


def _prefixes(cfg: DataConfig) -> list[str]:
    flags = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
    paths = (cfg.data_path, cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path)
    found = [p for flag, path in zip(flags, paths) if path for p in parse_blend(path, flag=flag)[0]]
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    sys.exit(main())
