"""MockGPTDataset for ``--mock-data``: deterministic, learnable samples with no files.

Sample i is a function of (seed, split, i) only: a numpy Generator seeded from those draws a start
token and a stride from ``STRIDES``, and the sample is the arithmetic progression
``start, start + stride, ...`` (seq_length + 1 tokens) modulo the number of non-eod ids. The eod id
never appears. A tiny model learns the pattern (the next token is fixed by the last two) within tens
of steps, which makes it a useful smoke test of the whole training path.
"""

from __future__ import annotations

import numpy as np

STRIDES = (1, 2, 3, 5)
_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset:
    """``num_samples`` int64 samples of ``seq_length + 1`` tokens in ``[0, vocab_size)``, no eod."""

    def __init__(
        self,
        *,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        eod: int,
        seed: int,
        split_name: str = "train",
    ):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 ids, got {vocab_size}")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.num_ids = int(vocab_size) - 1  # every id but eod
        self.eod = int(eod)
        self.seed = int(seed)
        self.split_id = _SPLIT_IDS[split_name]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} outside [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_id, int(i)])
        start = int(rng.integers(self.num_ids))
        stride = int(rng.choice(STRIDES))
        tokens = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.num_ids
        tokens[tokens >= self.eod] += 1  # skip the eod id wherever it sits
        return tokens
