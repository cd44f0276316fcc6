"""Pretrain a GPT model (GPT-2 or Llama family) with tensor, sequence and data parallelism.

Takes Megatron-LM's flag names. Examples:

    # one plain process on CPU, synthetic data
    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 5

    # 4 processes: TP 2 x DP 2
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

A bad flag or combination prints one line ``error: ...`` and exits with status 2 (so does a config
parsed for one world size and run on another); a run stopped by a NaN/inf loss prints
``error: iteration N: ...`` and exits with status 1.
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
    from megalite.training.arguments import flag_message, parse_args, with_tokenizer
    from megalite.training.config import ConfigError
    from megalite.training.pretrain import TrainingError, pretrain

    try:
        cfg = with_tokenizer(parse_args(argv))
        pretrain(cfg)
    except ConfigError as e:  # a bad flag, or a config parsed for another world size
        print(f"error: {flag_message(str(e))}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
