"""Helpers shared by the data tests: the shared fixture's location and small synthetic datasets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests.paths import ROOT as REPO


def shared_fixture(name: str) -> Path:
    """``<repo>/../shared/fixtures/<name>`` (CI layout), or ``$MEGALITE_SHARED/fixtures/<name>``;
    skips the test with a reason when neither exists."""
    candidates = [REPO.parent / "shared" / "fixtures" / name]
    if os.environ.get("MEGALITE_SHARED"):
        candidates.append(Path(os.environ["MEGALITE_SHARED"]) / "fixtures" / name)
    for c in candidates:
        if c.is_dir():
            return c
    pytest.skip(f"fixture {name} not found in {[str(c) for c in candidates]}")


def write_dataset(prefix: str | Path, docs: list, dtype=np.uint16) -> str:
    """Write ``docs`` (lists of ids) as one-sequence documents; returns the prefix."""
    with IndexedDatasetBuilder(str(prefix), dtype=dtype) as b:
        for d in docs:
            b.add_document(np.asarray(d, dtype=np.int64))
    return str(prefix)


def random_docs(rng: np.random.Generator, n: int, *, max_len: int, vocab: int, min_len: int = 0):
    return [rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))) for _ in range(n)]


def write_jsonl(path: str | Path, records: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def files_in(folder: str | Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())
