"""``TikTokenizer``: Megatron-LM's tiktoken-format tokenizer, in pure Python.

``--tokenizer-type TikTokenizer --tokenizer-model vocab.json --tiktoken-pattern {v1,v2}
[--tiktoken-num-special-tokens S (1000)] [--vocab-size V (131072)]``.

The vocabulary file is Megatron's JSON list of ``{"rank": r, "token_bytes": base64,
"token_str": ...}`` (entry r has rank r; the first 256 are the single bytes), or tiktoken's text
format (``base64 rank`` lines). As in Megatron: the first S ids are the special tokens ``<unk>``,
``<s>``, ``</s>``, then ``<SPECIAL_3>`` ... ``<SPECIAL_{S-1}>``; the file's first V - S entries
follow as ids S ... V - 1; ``vocab_size`` is V; ``eod`` is ``</s>`` (id 2).

``tokenize`` is tiktoken's ``encode_ordinary`` (special-token text is ordinary text; no bos/eos
added): each piece of the pattern that is a whole vocabulary entry is one id, any other is merged
by ``bpe.merge_byte_pairs``. ``detokenize`` decodes UTF-8 with replacement characters. The
``tiktoken`` package is not needed (the tests compare with it when it is installed).
"""

from __future__ import annotations

import base64
import json
import os

from megalite.data.bpe import compile_pattern, merge_byte_pairs
from megalite.data.tokenizer_base import Tokenizer

# Megatron-LM's two pre-tokenisation patterns (--tiktoken-pattern v1 / v2).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
DEFAULT_VOCAB_SIZE = 2**17  # Megatron's when --vocab-size is not given
_CACHE_LIMIT = 200_000


class TikTokenizer(Tokenizer):
    """See the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        pattern: str,
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
    ):
        if pattern not in PATTERNS:
            raise ValueError(
                f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern!r}"
            )
        if not path or not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {path}: no such tiktoken vocabulary file")
        self.path, self.pattern_name = path, pattern
        self.vocab_size = int(vocab_size) if vocab_size is not None else DEFAULT_VOCAB_SIZE
        self.num_special_tokens = int(num_special_tokens)
        s, v = self.num_special_tokens, self.vocab_size
        if not len(SPECIAL_TOKENS) <= s < v:
            raise ValueError(
                f"need {len(SPECIAL_TOKENS)} <= --tiktoken-num-special-tokens ({s}) < "
                f"--vocab-size ({v})"
            )
        if v - s < 256:
            raise ValueError(
                f"--vocab-size {v} - --tiktoken-num-special-tokens {s} = {v - s} leaves no room "
                "for the 256 single-byte tokens; raise --vocab-size"
            )
        ranks = _read_ranks(path)
        if len(ranks) < v - s:
            raise ValueError(
                f"--tokenizer-model {path} has {len(ranks)} tokens, fewer than --vocab-size {v} "
                f"- --tiktoken-num-special-tokens {s} = {v - s}; pass --vocab-size {len(ranks) + s}"
            )
        self.ranks = {t: r for t, r in ranks.items() if r < v - s}
        self.special_tokens = [*SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(3, s))]
        self.unk, self.bos, self.eos = 0, 1, 2
        self.eod = self.eos
        self._token_bytes = {r: t for t, r in self.ranks.items()}
        self._pattern = compile_pattern(PATTERNS[pattern], tokenizer_type="TikTokenizer")
        self._cache: dict[str, list[int]] = {}

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pattern.findall(text):
            ids.extend(self._piece_ids(piece))
        return ids

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            data, s = piece.encode("utf-8"), self.num_special_tokens
            whole = self.ranks.get(data)
            if whole is not None:
                ids = [whole + s]
            else:
                ids = [self.ranks[p] + s for p in merge_byte_pairs(data, self.ranks)]
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def detokenize(self, ids: list[int]) -> str:
        s = self.num_special_tokens
        out = bytearray()
        for i in ids:
            i = int(i)
            out.extend(self.special_tokens[i].encode() if i < s else self._token_bytes[i - s])
        return out.decode("utf-8", errors="replace")

    def __getstate__(self) -> dict:
        return {
            "path": self.path,
            "pattern": self.pattern_name,
            "vocab_size": self.vocab_size,
            "num_special_tokens": self.num_special_tokens,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.pop("path"), **state)


def _read_ranks(path: str) -> dict[bytes, int]:
    """Megatron's JSON list (``.json``) or tiktoken's ``base64 rank`` lines -> {bytes: rank}; the
    ranks must be 0 .. n-1 and the first 256 the single bytes (every piece can then be merged)."""
    ranks: dict[bytes, int] = {}
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            entries = json.load(f)
            if not isinstance(entries, list):
                raise ValueError(f"--tokenizer-model {path}: expected a JSON list of tokens")
            for i, e in enumerate(entries):
                if not isinstance(e, dict) or "token_bytes" not in e or e.get("rank") != i:
                    raise ValueError(
                        f"--tokenizer-model {path}: entry {i} is not "
                        f'{{"rank": {i}, "token_bytes": ...}}'
                    )
                ranks[base64.b64decode(e["token_bytes"])] = i
        else:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                parts = line.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    raise ValueError(
                        f"--tokenizer-model {path}:{line_no}: expected 'base64 rank', got "
                        f"{line.strip()[:40]!r}"
                    )
                ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..{len(ranks) - 1}, each once")
    for b in range(256):
        if ranks.get(bytes([b])) != b:
            raise ValueError(f"--tokenizer-model {path}: rank {b} must be the single byte {b}")
    return ranks
