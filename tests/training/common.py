"""Shared pieces of the training tests: tiny model flags, and running N steps of the real loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.arguments import parse_args
from megalite.training.config import PretrainConfig, with_tokenizer
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import Trainer, TrainResult, build_run

# h=32, 2 layers, seq 16, vocab 127 + eod = 128 ids: tiny, but every code path of both families.
BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
    "--train-iters 5 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1000 --eval-iters 0 --seed 7"
).split()
FAMILIES = {
    "gpt2": [],
    "llama": (
        "--position-embedding-type rope --normalization RMSNorm --swiglu --ffn-hidden-size 64 "
        "--group-query-attention --num-query-groups 2 --disable-bias-linear "
        "--untie-embeddings-and-output-weights --norm-epsilon 1e-6"
    ).split(),
}

# MoE flags of each family (GPT-2: every layer, all-to-all dispatcher; Llama: every other layer,
# allgather dispatcher, a gated shared expert, grouped GEMM), and aux/z losses strong enough to
# move grads visibly.
MOE = {
    "gpt2": (
        "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-aux-loss-coeff 0.01 "
        "--moe-z-loss-coeff 0.001 --moe-token-dispatcher-type alltoall --log-interval 1"
    ).split(),
    "llama": (
        "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-aux-loss-coeff 0.01 "
        "--moe-z-loss-coeff 0.001 --moe-token-dispatcher-type allgather --moe-layer-freq [0,1] "
        "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-grouped-gemm "
        "--log-interval 1"
    ).split(),
}
STRONG_AUX = ("--moe-aux-loss-coeff", "1.0", "--moe-z-loss-coeff", "0.1")


def config(*extra: str, world_size: int = 1, rank: int = 0) -> PretrainConfig:
    """The tiny model's config as the launcher of a ``world_size``-rank job would see it."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    return with_tokenizer(parse_args([*BASE, *extra], env=env))


def trainer_and_data(
    cfg: PretrainConfig, ps: ParallelState, *, dropout_seeded: bool = False
) -> tuple[Trainer, list[Iterator]]:
    """``pretrain``'s own assembly (``build_run``) on CPU and the mesh ``ps``, without loading
    ``--load`` (the tests that need it call ``checkpoint_io.load_checkpoint``): the Trainer and
    this DP rank's mock-data train iterators (one per model chunk)."""
    run = build_run(cfg, ps, torch.device("cpu"), seed_rng=dropout_seeded, resume=False)
    return run.trainer, run.train_iter


def train_losses(
    cfg: PretrainConfig, ps: ParallelState, *, dropout_seeded: bool = False
) -> TrainResult:
    """Run ``cfg.training.train_iters`` iterations of the real loop on mock data (this DP rank's
    share of every global batch); the result holds the losses (every rank of the last stage)."""
    trainer, train_iter = trainer_and_data(cfg, ps, dropout_seeded=dropout_seeded)
    return trainer.train(make_forward_step(torch.device("cpu")), train_iter)


def assert_close_rel(actual: list[float], expected: list[float], rel: float, what: str) -> None:
    assert len(actual) == len(expected), (what, actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{what}: step {i + 1}: {a!r} vs {e!r} (rel {rel})"


class LogCapture(logging.Handler):
    """Collect the INFO+ messages of the ``megalite`` loggers while installed (``with`` block)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogCapture:
        self._logger = logging.getLogger("megalite")
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
