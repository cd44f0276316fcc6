r"""Convert a local HuggingFace folder (GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE) to a
megalite checkpoint, to continue pretraining it under any layout.

Usage:
    python tools/convert_hf_to_megalite.py --load hf/gpt2 --save checkpoints/gpt2 \
        [--tensor-model-parallel-size 2] [--pipeline-model-parallel-size 2] \
        [--make-vocab-size-divisible-by 128]

Writes SAVE/release/mp_rank_XX[_YYY]/model_optim_rng.pt (weights only) and the tracker "release",
then prints the model flags for pretrain_gpt.py. `--load SAVE` takes the weights and starts at
iteration 0 with a fresh optimizer, under this layout or any other (resharded on load). Reads
model.safetensors (single or indexed) or pytorch_model.bin; nothing is downloaded. The work is in
megalite.conversion.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from megalite.conversion import import_from_hf, megalite_flags
from megalite.errors import ArgumentParser, run_main


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="the HuggingFace model folder")
    p.add_argument("--save", required=True, help="the megalite checkpoint directory to write")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    args = p.parse_args(argv)
    started = time.perf_counter()
    config, iter_dir = import_from_hf(
        args.load,
        args.save,
        tp_size=args.tensor_model_parallel_size,
        pp_size=args.pipeline_model_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    flags = megalite_flags(config)
    has_tokenizer = any(
        os.path.isfile(os.path.join(args.load, n)) for n in ("tokenizer.json", "tokenizer.model")
    )
    tokenizer = (
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", args.load]
        if has_tokenizer
        else ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1)]
    )
    print(f"wrote {iter_dir} ({time.perf_counter() - started:.1f} s); continue pretraining with:")
    print(
        "  "
        + shlex.join(["pretrain_gpt.py", *flags, *tokenizer, "--load", args.save])
        + " --seq-length ... (and your data, batch and optimizer flags)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
