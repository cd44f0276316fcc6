"""Pretrain a GPT model (GPT-2 or Llama family) with tensor, sequence and data parallelism.

Takes Megatron-LM's flag names. Examples:

    # one plain process on CPU, synthetic data
    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 5

    # 4 processes: TP 2 x DP 2
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

A bad flag or combination prints one line ``error: ...`` and exits with status 2; a run stopped by a
NaN/inf loss prints ``error: iteration N: ...`` and exits with status 1.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        from megalite.training.arguments import build_parser

        build_parser().print_help()
        return 0
    from megalite.training.arguments import parse_args
    from megalite.training.config import ConfigError
    from megalite.training.pretrain import TrainingError, pretrain

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        pretrain(cfg)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
