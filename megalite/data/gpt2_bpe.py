"""``GPT2BPETokenizer``: GPT-2's byte-level BPE from a ``vocab.json`` and a ``merges.txt``.

Megatron's default tokenizer (``--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json
--merge-file gpt2-merges.txt``). ``vocab.json`` maps token strings (bytes through
``bpe.byte_to_unicode``) to ids; ``merges.txt`` is a ``#version`` header line, then one merge
``left right`` a line, highest priority first. ``vocab_size`` is the number of vocab.json entries
and ``eod`` the id of ``<|endoftext|>``, as in Megatron-LM.

Text is split around the literal ``<|endoftext|>`` (which becomes ``eod``, as Megatron's
HuggingFace-backed GPT2BPETokenizer and HuggingFace's GPT2Tokenizer do; Megatron's legacy tokenizer
instead spelled it out as ordinary text); each other span is cut by ``bpe.GPT2_PATTERN`` and every
piece merged by ``bpe.merge_symbol_pairs``. A merged symbol missing from vocab.json becomes id 0, as
in Megatron's GPT-2 tokenizer (it cannot happen with a consistent vocab/merges pair). Pieces are
cached. Decoding maps ids back to bytes and decodes UTF-8 with replacement characters.
"""

from __future__ import annotations

import json
import os

from megalite.data.bpe import GPT2_PATTERN, byte_to_unicode, compile_pattern, merge_symbol_pairs
from megalite.data.tokenizer_base import Tokenizer

EOD_TOKEN = "<|endoftext|>"
_CACHE_LIMIT = 200_000  # pieces; the cache is emptied when it reaches this size


class GPT2BPETokenizer(Tokenizer):
    """See the module docstring."""

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"GPT2BPETokenizer {flag} {path}: no such file")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        if not isinstance(self.encoder, dict):
            raise ValueError(f"--vocab-file {vocab_file} is not a JSON object of token -> id")
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"--vocab-file {vocab_file} has no {EOD_TOKEN} token (the eod)")
        self.decoder = {int(i): t for t, i in self.encoder.items()}
        self.ranks = _read_merges(merge_file)
        self.vocab_size = len(self.encoder)
        self.eod = int(self.encoder[EOD_TOKEN])
        self._byte_map = byte_to_unicode()
        self._byte_unmap = {c: b for b, c in self._byte_map.items()}
        self._pattern = compile_pattern(GPT2_PATTERN, tokenizer_type="GPT2BPETokenizer")
        self._cache: dict[str, list[int]] = {}

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, span in enumerate(text.split(EOD_TOKEN)):
            if i:
                ids.append(self.eod)
            for piece in self._pattern.findall(span):
                ids.extend(self._piece_ids(piece))
        return ids

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            symbols = [self._byte_map[b] for b in piece.encode("utf-8")]
            ids = [self.encoder.get(s, 0) for s in merge_symbol_pairs(symbols, self.ranks)]
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def detokenize(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            for c in self.decoder[int(i)]:
                b = self._byte_unmap.get(c)
                out.extend(c.encode("utf-8") if b is None else (b,))
        return out.decode("utf-8", errors="replace")

    def __getstate__(self) -> dict:
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["vocab_file"], state["merge_file"])


def _read_merges(path: str) -> dict[tuple[str, str], int]:
    """``merges.txt`` -> {(left, right): rank}; a first line starting with ``#version`` and blank
    lines are skipped; a repeated pair keeps its last rank, as in GPT-2's reader."""
    ranks: dict[tuple[str, str], int] = {}
    rank = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if (line_no == 1 and line.startswith("#version")) or not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"--merge-file {path}:{line_no}: expected 'left right', got {line.strip()!r}"
                )
            ranks[(parts[0], parts[1])] = rank
            rank += 1
    return ranks
