"""``HuggingFaceTokenizer``: a local HuggingFace tokenizer (``tokenizer.json`` or a folder).

``tokenizers`` and ``transformers`` are optional dependencies, imported when one is built.
"""

from __future__ import annotations

import json
import os

from megalite.data.tokenizer_base import Tokenizer, TokenizerError


class HuggingFaceTokenizer(Tokenizer):
    """A local ``tokenizer.json`` (through ``tokenizers``) or a local folder (through
    ``transformers.AutoTokenizer``, falling back to the folder's tokenizer.json). Nothing is
    downloaded. ``tokenize`` adds the tokenizer's own special tokens (e.g. Llama's BOS), as
    Megatron's HuggingFaceTokenizer does; ``eod`` is the eos token.
    """

    _EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")

    def __init__(self, model_path: str):
        if not os.path.exists(model_path):
            raise TokenizerError(
                f"--tokenizer-model {model_path}: no such tokenizer.json or folder"
            )
        self.model_path = model_path
        self._hf = None  # transformers tokenizer
        self._tk = None  # tokenizers.Tokenizer
        if os.path.isdir(model_path):
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            except (ImportError, OSError, ValueError):
                pass
            if self._hf is None:
                model_path = os.path.join(model_path, "tokenizer.json")
        if self._hf is not None:
            self.vocab_size = len(self._hf)
            eos = self._hf.eos_token_id
            if eos is None:
                vocab = self._hf.get_vocab()
                eos = next((vocab[t] for t in self._EOS_CANDIDATES if t in vocab), None)
        else:
            try:
                from tokenizers import Tokenizer as RawTokenizer
            except ImportError:
                raise ImportError(
                    "HuggingFaceTokenizer needs the 'tokenizers' package: pip install -e .[hf]"
                ) from None
            self._tk = RawTokenizer.from_file(model_path)
            self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
            eos = self._eos_from_json(model_path)
        if eos is None:
            raise TokenizerError(
                f"--tokenizer-model {self.model_path} has no eos token (tried "
                f"{', '.join(self._EOS_CANDIDATES)}); add one so the tokenizer has an eod id"
            )
        self.eod = int(eos)

    def _eos_from_json(self, path: str) -> int | None:
        with open(path, encoding="utf-8") as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
        for name in self._EOS_CANDIDATES:
            tid = added.get(name, self._tk.token_to_id(name))
            if tid is not None:
                return tid
        return None

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text)["input_ids"])
        return self._tk.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._hf is not None:
            return [list(x) for x in self._hf(texts)["input_ids"]]
        return [e.ids for e in self._tk.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids])
        return self._tk.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])
