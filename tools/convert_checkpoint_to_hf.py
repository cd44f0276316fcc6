r"""Convert a megalite checkpoint (any TP / PP / DP layout) to a HuggingFace model folder.

Usage:
    python tools/convert_checkpoint_to_hf.py --load checkpoints/run1 --save hf/run1 \
        [--iteration N] [--dtype auto|fp32|bf16|fp16] [--max-shard-size 5GB] [--verify]

Writes config.json, model.safetensors (model-0000i-of-0000n.safetensors + index above
--max-shard-size), generation_config.json and the run's tokenizer files (SentencePiece: a
tokenizer.model that LlamaTokenizer / AutoTokenizer load offline; HuggingFace: its files), as
GPT2LMHeadModel (GPT-2 family) or LlamaForCausalLM (Llama family), the vocabulary padding removed
(MoE: MixtralForCausalLM, or Qwen2MoeForCausalLM with a shared expert; --add-qkv-bias: Qwen2;
--window-size LEFT,0: MistralForCausalLM with sliding_window LEFT + 1).
--verify loads the result with transformers and prints the largest logit difference against
megalite.load_model on a fixed batch; it exits 1 above --verify-tolerance (default 1e-4, for fp32).
The work is in megalite.conversion.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from megalite.conversion import export_to_hf, hf_logit_difference
from megalite.conversion.hf_files import parse_size
from megalite.errors import ArgumentParser, run_main


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="the megalite --save directory (or an iter_*)")
    p.add_argument("--iteration", help="which iteration (default: the latest complete one)")
    p.add_argument("--save", required=True, help="the HuggingFace folder to write")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="weights' dtype (auto: the run's --bf16/--fp16/fp32)",
    )
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--verify-tolerance", type=float, default=1e-4)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    iteration = args.iteration
    if iteration is not None and iteration != "release":
        iteration = int(iteration)
    started = time.perf_counter()
    out = export_to_hf(
        args.load,
        args.save,
        iteration=iteration,
        dtype=args.dtype,
        max_shard_size=parse_size(args.max_shard_size),
    )
    model = out["model"]
    print(
        f"wrote {args.save}: {out['family']} ({model.checkpoint_info['path']}), "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, files "
        f"{', '.join(out['files'])}; tokenizer: {', '.join(out['tokenizer_files']) or 'none'} "
        f"({time.perf_counter() - started:.1f} s)"
    )
    if args.verify:
        diff = hf_logit_difference(args.save, model)
        ok = diff <= args.verify_tolerance
        print(
            f"verify: largest |logit difference| transformers vs load_model = {diff:.3e} "
            f"({'ok' if ok else 'FAILED'}, tolerance {args.verify_tolerance:g})"
        )
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
