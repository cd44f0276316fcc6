r"""Tokenise a jsonl corpus into Megatron indexed datasets: {prefix}_{key}_document.bin/.idx.

Usage:
    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --json-keys text --append-eod --workers 8 [--log-interval 1000] [--skip-bad-lines]

    python tools/preprocess_data.py --input ids.jsonl --output-prefix data/ids \
        --tokenizer-type NullTokenizer --vocab-size 50000 --append-eod --workers 2

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/gpt2 \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --append-eod --workers 8

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/c \
        --tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt \
        --split-sentences [--lang english] [--keep-newlines]    # -> data/c_text_sentence.bin/.idx
    (needs NLTK and its punkt_tab model: pip install nltk; python -m nltk.downloader punkt_tab)

Tokenizer types and their flags: GPT2BPETokenizer (--vocab-file, --merge-file);
SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (a bos first) and
HuggingFaceTokenizer (--tokenizer-model); TikTokenizer (--tokenizer-model, --tiktoken-pattern v1|v2,
--tiktoken-num-special-tokens, --vocab-size); NullTokenizer (--vocab-size).

Flags follow Megatron-LM's tools/preprocess_data.py. Progress goes to stderr (documents/s, MB/s,
elapsed) with a final summary; a bad line is an error naming the file and line unless
--skip-bad-lines. Outputs appear only when the run succeeds. The work is in
megalite.data.preprocess.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from megalite.data.config import TOKENIZER_TYPES
from megalite.data.preprocess import preprocess_jsonl
from megalite.data.sentence_split import PunktSplitter
from megalite.data.tokenizers import make_tokenizer
from megalite.errors import ArgumentParser, run_main


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input", required=True, help="a .jsonl, .json (one object a line) or .jsonl.gz"
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenise (text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help=".model file, tokenizer.json or folder, or TikTokenizer's vocabulary",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: ids 0..V-1, eod V; TikTokenizer: vocabulary size (131072)",
    )
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer's pattern")
    p.add_argument(
        "--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer (1000)"
    )
    p.add_argument("--append-eod", action="store_true", help="append the eod id to each document")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    p.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    p.add_argument(
        "--skip-bad-lines", action="store_true", help="skip and count malformed lines, not fail"
    )
    p.add_argument("--chunk-lines", type=int, default=512, help="lines per worker task")
    p.add_argument(
        "--split-sentences",
        action="store_true",
        help="one sequence per sentence (NLTK punkt); writes PREFIX_{key}_sentence.bin/.idx",
    )
    p.add_argument(
        "--keep-newlines", action="store_true", help="keep newlines between split sentences"
    )
    p.add_argument("--lang", default="english", help="punkt's language (english)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    splitter = None
    if args.split_sentences:  # checked before any output is opened
        splitter = PunktSplitter(args.lang, args.keep_newlines)
        splitter.check()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so temp files go too
    try:
        tokenizer = make_tokenizer(
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tiktoken_pattern=args.tiktoken_pattern,
            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        )
        preprocess_jsonl(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
            skip_bad_lines=args.skip_bad_lines,
            chunk_lines=args.chunk_lines,
            sentence_splitter=splitter,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
