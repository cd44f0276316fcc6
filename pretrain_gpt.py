"""Pretrain a GPT model (GPT-2 or Llama family) with tensor, sequence and data parallelism.

Takes Megatron-LM's flag names. Examples:

    # one plain process on CPU, synthetic data
    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 5

    # 4 processes: TP 2 x DP 2
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

A user error -- a bad flag or combination, a missing or malformed input (dataset index, tokenizer
model), token ids outside the vocabulary, an empty split, an output folder that cannot be written, a
full disk at a save -- prints one line ``error: ...`` naming the flag or file and exits non-zero:
status 2 for flags (also a config parsed for one world size and run on another), 1 otherwise (a run
stopped by a NaN/inf loss prints ``error: iteration N: ...``). Inputs and outputs are checked at
start-up, before any process group (megalite.training.startup_checks); a bug shows its traceback.

Besides the training log, the first step is held against the planner's prediction for the run's
own layout (``megalite.measure.first_step``): one line each, and TensorBoard scalars.
"""

from __future__ import annotations

import sys

from megalite.errors import run_main
from megalite.measure.first_step import FirstStepComparison
from megalite.training.arguments import build_parser, flag_message, parse_args, with_tokenizer
from megalite.training.config import ConfigError
from megalite.training.pretrain import TrainingError, pretrain


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    return run_main(_pretrain, argv, user_errors={TrainingError: 1})


def _pretrain(argv: list[str]) -> int:
    try:
        cfg = with_tokenizer(parse_args(argv))
        pretrain(cfg, first_step_hooks=[FirstStepComparison()])
    except ConfigError as e:  # field names (a config parsed for another world size) -> flags
        raise ConfigError(flag_message(str(e))) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
