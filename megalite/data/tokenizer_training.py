"""Train a SentencePiece model from jsonl, the work behind ``tools/train_tokenizer.py``.

Input is streamed: documents are read line by line from ``.jsonl`` / ``.jsonl.gz`` files and each
non-empty line of each document's text is handed to the SentencePiece trainer as one sentence
(SentencePiece drops sentences longer than ``max_sentence_length`` bytes, so whole documents would
be lost). The trainer samples at most ``input_sentence_size`` sentences (0: all) to bound memory.
Special ids: unk 0, bos 1, eos 2 (the eod), pad 3 (or -1 for none).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterator
from itertools import chain

from megalite.errors import UserError, check_writable_dir, one_line, read_error

logger = logging.getLogger(__name__)


def iter_jsonl_texts(paths: list[str], json_keys: list[str]) -> Iterator[str]:
    """Each non-empty line of each ``json_keys`` string of each JSON line; bad lines are skipped
    with a warning (the tokenizer only needs representative text)."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        number = 0
        try:
            with opener(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        doc = json.loads(raw)
                    except ValueError as e:
                        logger.warning("skipping %s:%d: malformed JSON (%s)", path, number, e)
                        continue
                    for key in json_keys:
                        text = doc.get(key) if isinstance(doc, dict) else None
                        if isinstance(text, str):
                            for line in text.split("\n"):
                                if line.strip():
                                    yield line
        except (EOFError, OSError, zlib.error) as e:  # a truncated .gz, an unreadable file
            raise read_error(path, e, line=number) from None


def train_sentencepiece(
    inputs: list[str],
    model_prefix: str,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    json_keys: list[str] | tuple[str, ...] = ("text",),
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    keep_whitespace: bool = False,
    input_sentence_size: int = 10_000_000,
    max_sentence_length: int = 16384,
    pad_id: int = 3,
    num_threads: int = 1,
    seed_sentencepiece_size: int = 1_000_000,
) -> str:
    """Train and write ``{model_prefix}.model`` / ``.vocab``; returns the ``.model`` path."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise UserError(f"--model-type {model_type!r}: use bpe or unigram")
    for path in inputs:
        if not os.path.isfile(path):
            raise UserError(f"--input {path}: no such file")
    if vocab_size < 8:
        raise UserError(f"--vocab-size {vocab_size} is too small; use at least 8")
    folder = os.path.dirname(os.path.abspath(model_prefix))
    check_writable_dir(folder, flag="--model-prefix", what="tokenizer model")
    options = dict(
        model_prefix=model_prefix,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        # code and other whitespace-structured text: no NFKC, keep runs of spaces and newlines
        # (newlines then come back through byte fallback, indentation as whitespace pieces)
        normalization_rule_name="identity" if keep_whitespace else "nmt_nfkc",
        remove_extra_whitespaces=not keep_whitespace,
        allow_whitespace_only_pieces=keep_whitespace,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=max_sentence_length,
        seed_sentencepiece_size=seed_sentencepiece_size,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=pad_id,
        num_threads=num_threads,
        minloglevel=2,
    )
    sentences = iter_jsonl_texts(list(inputs), list(json_keys))
    first = next(sentences, None)  # SentencePiece asserts on an empty input: say it here
    if first is None:
        raise UserError(
            f"--input {' '.join(inputs)}: no text under --json-keys {' '.join(json_keys)} (empty "
            "or no such key in any JSON line); give jsonl files with text to train on"
        )
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=chain([first], sentences), **options)
    except RuntimeError as e:  # e.g. "Vocabulary size too high (N). Please set it to a value <= M."
        for suffix in (".model", ".vocab"):
            if os.path.exists(model_prefix + suffix):
                os.remove(model_prefix + suffix)
        raise UserError(
            f"--vocab-size {vocab_size} / --input: SentencePiece cannot train on this input "
            f"({one_line(str(e)).split('] ')[-1][:200]}); change --vocab-size or give more text"
        ) from None
    return model_prefix + ".model"
