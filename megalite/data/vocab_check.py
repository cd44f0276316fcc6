"""Do a dataset's token ids fit the vocabulary? The smallest and largest id of each ``.bin``.

An id at or beyond the model's padded vocabulary crashes in the embedding (TP = 1) or is masked by
the vocab-parallel embedding and trains silently (TP > 1); an id between the tokenizer's vocabulary
and the padded size trains an embedding row no tokenizer of the run can produce. Both are refused
before training: ``check_token_ids`` raises a ``DataError`` naming the file, the id and the
vocabulary. The range of a ``.bin`` is computed once (one streaming pass, ~GB/s) and cached beside
the dataset index caches (``index_cache``, in the folders ``cache_dirs`` picks), keyed by the
files' sizes and modification times, so later runs read it at once. Before any process group
exists, one rank per node reads the file; the node's other ranks wait for the entry it writes.
"""

from __future__ import annotations

import time

import numpy as np

from megalite.data import cache_dirs, index_cache
from megalite.data.cache_dirs import CacheDirs
from megalite.data.gpt_dataset import dataset_fingerprint, default_cache_dir
from megalite.data.indexed_dataset import IndexedDataset
from megalite.errors import DataError

_CHUNK = 1 << 26  # tokens per streamed block


def scan_token_range(indexed: IndexedDataset) -> tuple[int, int] | None:
    """(smallest, largest) id in ``indexed``'s ``.bin`` by one streaming pass; None when empty."""
    if indexed.num_tokens == 0 or indexed._bin_map is None:
        return None
    tokens = np.frombuffer(indexed._bin_map, dtype=indexed.dtype)  # [bin bytes / itemsize]
    low, high = None, None
    for start in range(0, tokens.shape[0], _CHUNK):
        block = tokens[start : start + _CHUNK]
        lo, hi = block.min(), block.max()
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    if indexed.dtype.kind == "f":
        return float(low), float(high)
    return int(low), int(high)


def token_range(
    indexed: IndexedDataset,
    *,
    cache_dir: str | None = None,
    scan: bool = True,
    wait_s: float = 600.0,
    flag: str = "--data-path",
) -> tuple[int, int] | None:
    """(smallest, largest) token id of ``indexed`` (None: no tokens), from a valid cache entry
    (``cache_dir``, else beside the data or the per-user folder: ``cache_dirs``).

    ``scan``: without an entry, this rank reads the ``.bin`` and caches its range. Pass it on one
    rank per node (local rank 0); the others (``scan=False``) wait up to ``wait_s`` seconds for
    that entry instead of reading the file too (a ``DataError`` naming ``flag`` when it does not
    come). A rank with no writable cache folder scans on its own: nobody could write the entry.
    """

    def build() -> dict[str, np.ndarray]:
        found = scan_token_range(indexed)
        values = [1.0, 0.0, 0.0] if found is None else [0.0, *found]  # [empty?, low, high]
        return {"range": np.asarray(values, dtype=np.float64)}

    description = {"kind": "TokenRange", "data": dataset_fingerprint(indexed)}
    dirs = cache_dirs.resolve(cache_dir, beside=default_cache_dir(indexed.prefix), writer=scan)
    if scan or dirs.write is None:
        arrays = index_cache.load_or_build(dirs, description, ["range"], build=build, write=scan)
    else:
        arrays = _wait_for_range(indexed, dirs, description, wait_s=wait_s, flag=flag)
    empty, low, high = (float(x) for x in arrays["range"])
    if empty:
        return None
    return (int(low), int(high)) if indexed.dtype.kind != "f" else (low, high)


def _wait_for_range(
    indexed: IndexedDataset, dirs: CacheDirs, description: dict, *, wait_s: float, flag: str
) -> dict[str, np.ndarray]:
    """The entry the scanning rank writes, polled every <= 1 s (no process group exists yet)."""
    description = dict(description, cache_format=index_cache.FORMAT_VERSION)
    deadline = time.monotonic() + wait_s
    pause = 0.02
    while True:
        for folder in dirs.read:
            arrays = index_cache.try_load(folder, description, ["range"])
            if arrays is not None:
                return arrays
        if time.monotonic() >= deadline:
            raise DataError(
                f"{flag} {indexed.prefix}.bin: waited {wait_s:.0f} s for local rank 0 to cache "
                f"its token-id range in {dirs.write}, and it did not (if local rank 0 stopped, "
                "its error says why); for a dataset too large to read in that time, build the "
                "cache first with tools/build_data_cache.py or raise "
                "--distributed-timeout-minutes"
            )
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 1.0)


def check_token_ids(
    indexed: IndexedDataset,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    flag: str = "--data-path",
    cache_dir: str | None = None,
    scan: bool = True,
    wait_s: float = 600.0,
) -> None:
    """Refuse (``DataError``) a dataset with an id outside ``[0, vocab_size)``: the tokenizer's
    ids, eod included; ``padded_vocab_size`` is named in the message (the model's rows). The range
    comes from ``token_range`` (``scan``, ``wait_s``: which rank reads the file)."""
    bin_path = indexed.prefix + ".bin"
    if indexed.dtype.kind == "f":
        raise DataError(
            f"{flag} {bin_path}: tokens are stored as {indexed.dtype}, not integers; "
            "re-tokenise with tools/preprocess_data.py"
        )
    found = token_range(indexed, cache_dir=cache_dir, scan=scan, wait_s=wait_s, flag=flag)
    if found is None:
        return
    low, high = found
    if low < 0:
        raise DataError(
            f"{flag} {bin_path}: holds the negative token id {low}; token ids run from 0 to the "
            f"vocabulary size {vocab_size} - 1; the file is corrupt or was not written as tokens"
        )
    if high >= vocab_size:
        where = (
            f"beyond the model's padded vocabulary of {padded_vocab_size} rows"
            if high >= padded_vocab_size
            else f"in the padding rows {vocab_size}..{padded_vocab_size - 1} of the model's "
            f"embedding (no tokenizer of this run produces them)"
        )
        raise DataError(
            f"{flag} {bin_path}: largest token id {high} does not fit the tokenizer's vocabulary "
            f"of {vocab_size} ids (0..{vocab_size - 1}); it is {where}; pass the tokenizer the "
            "data was made with (--tokenizer-type/--tokenizer-model/--vocab-size) or re-tokenise"
        )
