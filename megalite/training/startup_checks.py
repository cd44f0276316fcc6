"""Start-up checks: what depends only on the flags and the files, found before any process group.

    check_startup(cfg, launch)   # in pretrain(): tokenizer built, before init_distributed

Every rank runs them on its own (no collective, so a bad input ends each rank in a second with one
line, not after the model is built or at the first save):

- the device: ``--device cuda`` on a machine without CUDA;
- outputs writable (created as the run would): ``--save`` on every rank (each writes its shard),
  ``--tensorboard-dir`` on the rank that logs (the last), ``--data-cache-path`` on the ranks that
  build the index caches (local rank 0);
- inputs: every dataset the run reads opens (index header, sizes), every split it reads has tokens,
  and every token id fits the tokenizer's vocabulary (``megalite.data.builders.check_data``; the id
  range of each ``.bin`` is computed once, by local rank 0, and cached with the index caches; the
  node's other ranks wait for it).

Each failure is a ``UserError`` (one line naming the flag or file) for ``megalite.errors.run_main``.
"""

from __future__ import annotations

import torch

from megalite.data.builders import check_data, train_valid_test_num_samples
from megalite.errors import UserError, check_writable_dir
from megalite.training.config import PretrainConfig
from megalite.training.launch import LaunchInfo


def check_device(cfg: PretrainConfig) -> None:
    if cfg.parallel.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda (or --distributed-backend nccl): this machine has no CUDA device "
            "(torch.cuda.is_available() is False); drop the flag to run on CPU with gloo"
        )


def check_outputs(cfg: PretrainConfig, launch: LaunchInfo) -> None:
    """The folders this rank will write, created and probed now."""
    if cfg.training.save:
        check_writable_dir(cfg.training.save, flag="--save", what="checkpoints")
    board = cfg.logging.tensorboard_dir
    if board and launch.rank == launch.world_size - 1:  # the log rank writes the events
        check_writable_dir(board, flag="--tensorboard-dir", what="TensorBoard events")
    if cfg.data.data_cache_path and launch.local_rank == 0 and not cfg.data.mock_data:
        check_writable_dir(cfg.data.data_cache_path, flag="--data-cache-path", what="index caches")


def check_inputs(cfg: PretrainConfig, launch: LaunchInfo) -> None:
    """Datasets open, splits the run reads have tokens, token ids fit the vocabulary: local rank 0
    reads each uncached ``.bin``, the node's other ranks wait (as long as a collective would) for
    the range it caches."""
    t = cfg.training
    train, valid, test = train_valid_test_num_samples(
        train_iters=t.train_iters,
        global_batch_size=t.global_batch_size,
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
    )
    check_data(
        cfg.data,
        train_samples=train,
        valid_samples=valid,
        test_samples=test,
        vocab_size=cfg.tokenizer.vocab_size,
        padded_vocab_size=cfg.model.padded_vocab_size(cfg.parallel.tensor_model_parallel_size),
        scan=launch.local_rank == 0,
        wait_s=cfg.parallel.distributed_timeout_minutes * 60.0,
    )


def check_startup(cfg: PretrainConfig, launch: LaunchInfo) -> None:
    """All of the above for this rank; ``cfg`` carries its tokenizer (``with_tokenizer``)."""
    check_device(cfg)
    check_outputs(cfg, launch)
    check_inputs(cfg, launch)
