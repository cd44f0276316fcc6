"""Build a tokenizer from Megatron's flags: ``make_tokenizer`` / ``build_tokenizer``.

Megatron's NullTokenizer, GPT2BPETokenizer, the SentencePiece ones (SentencePieceTokenizer,
GPTSentencePieceTokenizer, Llama2Tokenizer), TikTokenizer and HuggingFace (optional dependency),
each in its own module under the interface of ``tokenizer_base``.
"""

from __future__ import annotations

from megalite.data.config import TOKENIZER_TYPES, DataConfig
from megalite.data.gpt2_bpe import GPT2BPETokenizer
from megalite.data.hf_tokenizer import HuggingFaceTokenizer
from megalite.data.null_tokenizer import NullTokenizer
from megalite.data.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megalite.data.tiktoken_tokenizer import TikTokenizer
from megalite.data.tokenizer_base import Tokenizer, TokenizerError
from megalite.errors import UserError, one_line

_SENTENCEPIECE = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}


def make_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
) -> Tokenizer:
    """Build a tokenizer from Megatron's flags: ``--tokenizer-type``, ``--tokenizer-model``,
    ``--vocab-size`` (NullTokenizer, TikTokenizer), ``--vocab-file`` / ``--merge-file``
    (GPT2BPETokenizer), ``--tiktoken-pattern`` / ``--tiktoken-num-special-tokens``. A file
    that cannot be read as that tokenizer is a ``TokenizerError`` naming the flag and the file."""
    files = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file}
    files["--merge-file"] = merge_file
    try:
        return _make_tokenizer(
            tokenizer_type,
            tokenizer_model=tokenizer_model,
            vocab_size=vocab_size,
            vocab_file=vocab_file,
            merge_file=merge_file,
            tiktoken_pattern=tiktoken_pattern,
            tiktoken_num_special_tokens=tiktoken_num_special_tokens,
        )
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        named = ", ".join(f"{flag} {path}" for flag, path in files.items() if path)
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type}: cannot read {named or 'its files'} "
            f"({type(e).__name__}: {one_line(str(e))[:200]}); pass files of that tokenizer type"
        ) from None


def _make_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None,
    vocab_size: int | None,
    vocab_file: str | None,
    merge_file: str | None,
    tiktoken_pattern: str | None,
    tiktoken_num_special_tokens: int,
) -> Tokenizer:
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size V (eod is V)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                "--merge-file (merges.txt)"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; use one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if not tokenizer_model:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return _SENTENCEPIECE[tokenizer_type](tokenizer_model)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer ``cfg`` names (``.vocab_size`` unpadded, ``.eod``, tokenize/detokenize)."""
    return make_tokenizer(
        cfg.tokenizer_type,
        tokenizer_model=cfg.tokenizer_model,
        vocab_size=cfg.vocab_size,
        vocab_file=cfg.vocab_file,
        merge_file=cfg.merge_file,
        tiktoken_pattern=cfg.tiktoken_pattern,
        tiktoken_num_special_tokens=cfg.tiktoken_num_special_tokens,
    )
