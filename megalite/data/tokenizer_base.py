"""The interface every tokenizer offers, and the error a tokenizer flag or file raises.

Every tokenizer offers ``vocab_size`` (unpadded: the model pads it for TP), ``eod`` (the id appended
after each document by ``tools/preprocess_data.py --append-eod`` and masked by ``--eod-mask-loss``),
``bos`` (the id a text starts with, or None where the tokenizer has none), ``tokenize(str) ->
list[int]`` and ``detokenize(list[int]) -> str``. Tokenizers are plain picklable objects so that
preprocessing workers can be handed one. The implementations live one per module
(``null_tokenizer``, ``sentencepiece_tokenizer``, ``hf_tokenizer``, ``gpt2_bpe``,
``tiktoken_tokenizer``); ``tokenizers.make_tokenizer`` builds one from Megatron's flags.
"""

from __future__ import annotations

from megalite.errors import UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer flag or file that cannot be used; one line naming the flag and the file."""


class Tokenizer:
    """The interface; see the module docstring."""

    vocab_size: int
    eod: int
    bos: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenise many texts; subclasses override when their library batches faster."""
        return [self.tokenize(t) for t in texts]
