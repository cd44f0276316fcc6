"""Megatron's ``NullTokenizer``: text is whitespace-separated integer ids, for synthetic data."""

from __future__ import annotations

from megalite.data.tokenizer_base import Tokenizer, TokenizerError


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: text is whitespace-separated integer ids in [0, V).

    ``eod`` is V, so the vocabulary is V + 1 (``vocab_size`` returns V + 1).
    """

    def __init__(self, vocab_size: int):
        if int(vocab_size) < 1:
            raise TokenizerError(f"--vocab-size must be >= 1 for NullTokenizer, got {vocab_size}")
        self._num_ids = int(vocab_size)
        self.eod = self._num_ids
        self.vocab_size = self._num_ids + 1

    def tokenize(self, text: str) -> list[int]:
        words = text.split()
        try:
            ids = list(map(int, words))
        except ValueError:
            bad = next(w for w in words if not _is_int(w))
            raise TokenizerError(
                f"NullTokenizer reads whitespace-separated integer ids, got {bad[:40]!r}"
            ) from None
        if ids and (min(ids) < 0 or max(ids) >= self._num_ids):
            bad = next(i for i in ids if not 0 <= i < self._num_ids)
            raise TokenizerError(
                f"NullTokenizer id {bad} is outside [0, {self._num_ids}) set by --vocab-size "
                f"{self._num_ids}; raise --vocab-size above the largest id"
            )
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True
