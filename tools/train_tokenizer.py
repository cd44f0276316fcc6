r"""Train a SentencePiece BPE or unigram tokenizer from jsonl, streaming the input.

Usage:
    python tools/train_tokenizer.py --input corpus.jsonl [more.jsonl.gz ...] --model-prefix tok \
        --vocab-size 32000 [--model-type bpe|unigram] [--json-keys text] \
        [--character-coverage 0.9995] [--no-byte-fallback] [--input-sentence-size 10000000]

Writes tok.model and tok.vocab (unk 0, bos 1, eos 2 = eod, pad 3). Use the model with
--tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model. With byte fallback (the
default) the vocabulary needs room for 256 byte pieces. The work is in
megalite.data.tokenizer_training.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megalite.data.tokenizer_training import train_sentencepiece
from megalite.errors import ArgumentParser, run_main


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl or .jsonl.gz files")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false")
    p.add_argument(
        "--keep-whitespace",
        action="store_true",
        help="no normalisation; keep newlines and runs of spaces (code corpora)",
    )
    p.add_argument("--input-sentence-size", type=int, default=10_000_000, help="0: every sentence")
    p.add_argument("--max-sentence-length", type=int, default=16384, help="bytes; longer skipped")
    p.add_argument("--pad-id", type=int, default=3, help="-1 for no pad piece")
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    path = train_sentencepiece(
        args.input,
        args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        json_keys=args.json_keys,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        keep_whitespace=args.keep_whitespace,
        input_sentence_size=args.input_sentence_size,
        max_sentence_length=args.max_sentence_length,
        pad_id=args.pad_id,
        num_threads=args.num_threads,
    )
    logging.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
