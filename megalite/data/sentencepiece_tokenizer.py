"""SentencePiece tokenizers: megalite's ``SentencePieceTokenizer`` and Megatron's
``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``, over one ``.model`` file.

``sentencepiece`` is imported when one is built, not when megalite is.
"""

from __future__ import annotations

import os

from megalite.data.tokenizer_base import Tokenizer, TokenizerError
from megalite.errors import one_line


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; ``eod`` is its eos id (which must be enabled)."""

    def __init__(self, model_path: str):
        import sentencepiece as spm  # an optional dependency, needed only for these tokenizers

        if not os.path.isfile(model_path):
            raise TokenizerError(
                f"--tokenizer-model {model_path}: no such SentencePiece .model file"
            )
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto from ..."
            raise TokenizerError(
                f"--tokenizer-model {model_path}: not a SentencePiece model "
                f"({one_line(str(e)).replace(f' from {model_path}', '')}); pass the .model file "
                "tools/train_tokenizer.py (or SentencePiece) wrote"
            ) from None
        self.vocab_size = int(self._sp.vocab_size())
        self.bos = _none_if_negative(self._sp.bos_id())
        self.eos = _none_if_negative(self._sp.eos_id())
        self.pad = _none_if_negative(self._sp.pad_id())
        self.unk = _none_if_negative(self._sp.unk_id())
        if self.eos is None:
            raise TokenizerError(
                f"--tokenizer-model {model_path} has no eos piece (eos_id=-1), so there is no eod; "
                "retrain it with an eos id (tools/train_tokenizer.py sets eos_id=2)"
            )
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPTSentencePieceTokenizer: the model's own ids (no pieces added), no bos/eos in
    ``tokenize``, ``eod`` = eos. (megalite's SentencePieceTokenizer has the same ids.)"""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: ``tokenize`` puts the bos id first (no eos), ``eod`` = eos."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        if self.bos is None:
            raise TokenizerError(
                f"--tokenizer-model {model_path} has no bos piece (bos_id=-1); Llama2Tokenizer "
                "starts every text with it"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self._sp.encode(texts)]


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else int(i)
