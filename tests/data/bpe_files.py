"""Small byte-level BPE vocabularies written by the tests (no download): a greedy BPE trainer
(the most frequent adjacent pair is merged, ties to the larger pair) and writers for GPT-2's
vocab.json / merges.txt and Megatron's TikTokenizer JSON list."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import regex

from megalite.data.bpe import GPT2_PATTERN, byte_to_unicode


def train_merges(texts: list[str], num_merges: int, pattern: str = GPT2_PATTERN) -> list:
    """Up to ``num_merges`` (left bytes, right bytes) merges learned from ``texts``."""
    words = Counter(p.encode() for t in texts for p in regex.findall(pattern, t))
    seqs = {w: [bytes([c]) for c in w] for w in words}
    merges = []
    for _ in range(num_merges):
        counts: Counter = Counter()
        for w, freq in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:]):
                counts[pair] += freq
        if not counts:
            break
        a, b = max(counts, key=lambda p: (counts[p], p))
        merges.append((a, b))
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def write_gpt2_files(folder: Path, merges: list) -> tuple[str, str]:
    """vocab.json (the 256 byte symbols as ids 0..255 in byte order, then one token per merge,
    then <|endoftext|>) and merges.txt (with its #version header); returns their paths."""
    m = byte_to_unicode()
    sym = lambda bs: "".join(m[c] for c in bs)
    vocab = {m[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(sym(a + b), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2", *(f"{sym(a)} {sym(b)}" for a, b in merges)]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def tiktoken_ranks(merges: list) -> dict[bytes, int]:
    """The 256 single bytes (ranks 0..255), then each merge's concatenation in order."""
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in merges:
        ranks.setdefault(a + b, len(ranks))
    return ranks


def write_tiktoken_json(path: Path, ranks: dict[bytes, int]) -> str:
    """Megatron's TikTokenizer file: a JSON list of {rank, token_bytes (base64), token_str}."""
    entries = [
        {
            "rank": r,
            "token_bytes": base64.b64encode(t).decode(),
            "token_str": t.decode("utf-8", "replace"),
        }
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)
