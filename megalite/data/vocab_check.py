"""Do a dataset's token ids fit the vocabulary? The smallest and largest id of each ``.bin``.

An id at or beyond the model's padded vocabulary crashes in the embedding (TP = 1) or is masked by
the vocab-parallel embedding and trains silently (TP > 1); an id between the tokenizer's vocabulary
and the padded size trains an embedding row no tokenizer of the run can produce. Both are refused
before training: ``check_token_ids`` raises a ``DataError`` naming the file, the id and the
vocabulary. The range of a ``.bin`` is computed once (one streaming pass, ~GB/s) and cached beside
the dataset index caches (``index_cache``), keyed by the files' sizes and modification times, so
later runs read it at once.
"""

from __future__ import annotations

import numpy as np

from megalite.data import index_cache
from megalite.data.gpt_dataset import dataset_fingerprint
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
    indexed: IndexedDataset, *, cache_dir: str | None, write: bool = True
) -> tuple[int, int] | None:
    """(smallest, largest) token id of ``indexed`` (None: no tokens), from the cache in
    ``cache_dir`` when valid, else scanned (and cached when ``write``)."""

    def build() -> dict[str, np.ndarray]:
        found = scan_token_range(indexed)
        values = [1.0, 0.0, 0.0] if found is None else [0.0, *found]  # [empty?, low, high]
        return {"range": np.asarray(values, dtype=np.float64)}

    description = {"kind": "TokenRange", "data": dataset_fingerprint(indexed)}
    arrays = index_cache.load_or_build(cache_dir, description, ["range"], build=build, write=write)
    empty, low, high = (float(x) for x in arrays["range"])
    if empty:
        return None
    return (int(low), int(high)) if indexed.dtype.kind != "f" else (low, high)


def check_token_ids(
    indexed: IndexedDataset,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    flag: str = "--data-path",
    cache_dir: str | None = None,
    write: bool = True,
) -> None:
    """Refuse (``DataError``) a dataset with an id outside ``[0, vocab_size)``: the tokenizer's
    ids, eod included; ``padded_vocab_size`` is named in the message (the model's rows)."""
    bin_path = indexed.prefix + ".bin"
    if indexed.dtype.kind == "f":
        raise DataError(
            f"{flag} {bin_path}: tokens are stored as {indexed.dtype}, not integers; "
            "re-tokenise with tools/preprocess_data.py"
        )
    found = token_range(indexed, cache_dir=cache_dir, write=write)
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
