"""GPTDataset: fixed-length samples over one split of an indexed dataset, Megatron's semantics.

A split owns a contiguous range of the dataset's documents (``--split 969,30,1``, by document; each
sequence of the indexed dataset is one document, as ``tools/preprocess_data.py`` writes them). Its
documents are laid end to end in a per-epoch shuffled order, cut into samples of seq_length + 1
tokens that run across document boundaries, with as many epochs as the requested sample count
needs, and the samples are shuffled (see ``index_builders``). ``ds[i]`` is an int64 array of
seq_length + 1 tokens. The index arrays are cached (``index_cache``).
"""

from __future__ import annotations

import os

import numpy as np

from megalite.data import index_cache
from megalite.data.index_builders import build_gpt_indices
from megalite.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir(prefix: str) -> str:
    """Beside the data, as Megatron does: ``dirname(prefix)/cache/GPTDataset_indices``."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def dataset_fingerprint(indexed: IndexedDataset) -> dict:
    """What identifies the files' contents in a cache key: absolute path, sizes, mtimes, counts."""
    idx_stat = os.stat(indexed.prefix + ".idx")
    bin_stat = os.stat(indexed.prefix + ".bin")
    return {
        "prefix": os.path.abspath(indexed.prefix),
        "idx_bytes": idx_stat.st_size,
        "idx_mtime_ns": idx_stat.st_mtime_ns,
        "bin_bytes": bin_stat.st_size,
        "bin_mtime_ns": bin_stat.st_mtime_ns,
        "num_sequences": len(indexed),
    }


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``[lo, hi)`` of ``indexed``.

    ``len(ds)`` is every sample of the epochs built (at least ``num_samples``; one epoch when
    None). ``cache_dir`` None means :func:`default_cache_dir`; ``write_cache`` False means this rank
    only reads the cache (building in memory if it is missing or invalid).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        *,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | None = None,
        write_cache: bool = True,
        use_cache: bool = True,
    ):
        lo, hi = documents
        if not 0 <= lo < hi <= len(indexed):
            raise ValueError(
                f"{split_name} split of {indexed.prefix}: document range [{lo}, {hi}) is empty or "
                f"outside its {len(indexed)} documents; adjust --split"
            )
        self.indexed = indexed
        self.seq_length = seq_length
        self.split_name = split_name
        self.description = {
            "kind": "GPTDataset",
            "data": dataset_fingerprint(indexed),
            "split": split_name,
            "documents": [lo, hi],
            "seq_length": seq_length,
            "seed": seed,
            "num_samples": num_samples,
        }
        sizes = indexed.sequence_lengths

        def build() -> dict[str, np.ndarray]:
            docs = np.arange(lo, hi, dtype=np.int64)
            return build_gpt_indices(
                np.asarray(sizes), docs, seq_length=seq_length, seed=seed, num_samples=num_samples
            )

        if cache_dir is None and use_cache:
            cache_dir = default_cache_dir(indexed.prefix)
        arrays = index_cache.load_or_build(
            cache_dir if use_cache else None,
            self.description,
            ["document_index", "sample_index", "shuffle_index"],
            build=build,
            write=write_cache,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        if num_samples is not None and len(self) < num_samples:
            raise RuntimeError(f"{split_name}: built {len(self)} samples, {num_samples} asked")

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` of the shuffled order: int64 tokens ``[seq_length + 1]``."""
        j = int(self.shuffle_index[i])
        pos, offset = (int(x) for x in self.sample_index[j])
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        sizes = self.indexed.sequence_lengths
        while filled < need:
            doc = int(self.document_index[pos])
            take = min(int(sizes[doc]) - offset, need - filled)
            out[filled : filled + take] = self.indexed.get(doc, offset, take)
            filled += take
            pos += 1
            offset = 0
        return out
