"""Synthetic corpora for the data benchmarks (written under /tmp, never committed)."""

from __future__ import annotations

import json
import os

import numpy as np


def make_words(rng: np.random.Generator, n: int = 5000) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(n)]


def write_corpus(path: str, megabytes: float, *, seed: int = 0) -> str:
    """A jsonl of ~``megabytes`` MB: documents of 50-1500 Zipf-distributed pseudo-words."""
    if os.path.exists(path) and os.path.getsize(path) >= megabytes * 1e6 * 0.98:
        return path
    rng = np.random.default_rng(seed)
    words = np.array(make_words(rng))
    target = int(megabytes * 1e6)
    written = 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            n = int(rng.integers(50, 1500))
            ids = np.minimum(rng.zipf(1.2, size=n) - 1, len(words) - 1)
            line = json.dumps({"text": " ".join(words[ids])}) + "\n"
            f.write(line)
            written += len(line)
    os.replace(tmp, path)
    return path


def write_id_corpus(path: str, megabytes: float, *, seed: int = 1, vocab: int = 50000) -> str:
    """A jsonl of ~``megabytes`` MB of NullTokenizer documents (50-1500 ids in [0, vocab))."""
    if os.path.exists(path) and os.path.getsize(path) >= megabytes * 1e6 * 0.98:
        return path
    rng = np.random.default_rng(seed)
    target = int(megabytes * 1e6)
    written = 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            ids = rng.integers(0, vocab, size=int(rng.integers(50, 1500)))
            line = '{"text": "' + " ".join(map(str, ids.tolist())) + '"}\n'
            f.write(line)
            written += len(line)
    os.replace(tmp, path)
    return path
