r"""Generate text with transformers from a HuggingFace folder (a converted megalite checkpoint).

Usage:
    python tools/generate_hf.py --model hf/run1 [--prompt "import os" --prompt "class"] \
        [--max-new-tokens 40] [--temperature 0.8] [--top-k 40] [--greedy] [--seed 1234]

Loads the model and tokenizer with AutoModelForCausalLM / AutoTokenizer, offline
(local_files_only), on CPU, and prints each prompt's continuation as ``prompt|continuation`` on
one line (newlines shown as ``⏎``). Prompts are encoded without special tokens: megalite's
pretraining data carries an end-of-document token after each document and no BOS. Sampling is
seeded, so a run prints the same lines twice. The work is in ``generate``.
"""

from __future__ import annotations

import argparse
import sys

from megalite.errors import ArgumentParser, UsageError, UserError, one_line, run_main

DEFAULT_PROMPTS = ("import os", "def __init__(self,", "class", "for i in range(")


def generate(
    model_dir: str,
    prompts: list[str] | tuple[str, ...] = DEFAULT_PROMPTS,
    *,
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 40,
    greedy: bool = False,
    seed: int = 1234,
) -> list[str]:
    """Each prompt's continuation (the new text only), in order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    # not every HF config has a position limit (e.g. RoPE models of some transformers versions)
    max_len = getattr(model.config, "max_position_embeddings", None) or 1024
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] == 0:
            raise ValueError(f"--prompt {prompt!r} encodes to no tokens; give some text")
        new = max(1, min(max_new_tokens, max_len - ids.shape[1]))
        torch.manual_seed(seed + i)
        sampling = {} if greedy else {"temperature": temperature, "top_k": top_k}
        with torch.no_grad():
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                pad_token_id=tokenizer.eos_token_id,
                do_sample=not greedy,
                **sampling,
            )
        out.append(tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a HuggingFace model folder")
    p.add_argument("--prompt", action="append", help="repeatable; default: a few Python openings")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature <= 0 or args.top_k < 1:
        raise UsageError(
            f"need --max-new-tokens >= 1 (got {args.max_new_tokens}), --temperature > 0 "
            f"(got {args.temperature}) and --top-k >= 1 (got {args.top_k})"
        )
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    try:
        texts = generate(
            args.model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            greedy=args.greedy,
            seed=args.seed,
        )
    except UserError:
        raise
    except (OSError, ValueError) as e:  # transformers: a missing or unreadable model folder
        raise UserError(f"--model {args.model}: {one_line(str(e))[:300]}") from None
    for prompt, text in zip(prompts, texts):
        print(f"{prompt}|{text}".replace("\n", "⏎"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
