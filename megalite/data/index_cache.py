"""On-disk cache of dataset index arrays, keyed by everything that determines them.

A cache entry is ``{key}-{kind}-{name}.npy`` per array plus ``{key}-{kind}-description.json``, where
``key`` is a hash of the *description* (a JSON dict: the data files' paths, sizes and modification
times, the documents used, seq_length, seed, sample count, weights, ...). The description file is
written last (renamed into place) and records each array's shape, dtype and blake2b digest; an entry
is used only when the description matches and every array checks out, so a stale, partial or
corrupt entry is rebuilt, never trusted.

Megatron-LM's own GPTDataset index files in the same folder (``--data-cache-path``, or Megatron's
default ``dirname(prefix)/cache/GPTDataset_indices``): ``{md5}-GPTDataset-{split}-description.txt``
beside ``-document_index.npy``, ``-sample_index.npy`` and ``-shuffle_index.npy``. The arrays mean
what megalite's mean (documents of each epoch in order, each sample's start as (position, offset),
the shuffled sample order), so when a description there names this dataset (the same prefix),
split, ``--seed``, ``--seq-length`` and sample count, and the arrays check out (dtypes, shapes,
every document of the split's range in the document index, a permutation-sized shuffle), megalite
uses them: the run then sees Megatron's sample order, as the Megatron run that wrote them did. A
Megatron entry for this dataset and split that differs is named in one line saying which setting
differs, and megalite builds its own (``try_load_megatron``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import numpy as np

from megalite.data.cache_dirs import CacheDirs

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def description_key(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _digest(arr: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    step = 64 << 20
    for start in range(0, flat.size, step):
        h.update(memoryview(flat[start : start + step]))
    return h.hexdigest()


def _paths(cache_dir: str, key: str, kind: str, names: list[str]) -> tuple[str, dict[str, str]]:
    base = os.path.join(cache_dir, f"{key}-{kind}")
    return base + "-description.json", {n: f"{base}-{n}.npy" for n in names}


def try_load(cache_dir: str, description: dict, names: list[str]) -> dict[str, np.ndarray] | None:
    """The cached arrays (memory-mapped, read-only) when a valid entry exists, else None."""
    description = json.loads(json.dumps(description))
    key = description_key(description)
    desc_path, array_paths = _paths(cache_dir, key, description["kind"], names)
    if not os.path.exists(desc_path):
        return None
    try:
        with open(desc_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("description") != description:
            logger.warning("index cache %s describes other settings; rebuilding", desc_path)
            return None
        arrays = {}
        for name in names:
            info = meta["arrays"][name]
            arr = np.load(array_paths[name], mmap_mode="r", allow_pickle=False)
            if list(arr.shape) != info["shape"] or str(arr.dtype) != info["dtype"]:
                raise ValueError(f"{array_paths[name]}: shape/dtype differ from the description")
            if _digest(arr) != info["blake2b"]:
                raise ValueError(f"{array_paths[name]}: checksum differs from the description")
            arrays[name] = np.asarray(arr)  # a plain ndarray view of the map: faster indexing
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        logger.warning("index cache entry %s is unusable (%s); rebuilding", desc_path, e)
        return None
    return arrays


def save(cache_dir: str, description: dict, arrays: dict[str, np.ndarray]) -> str | None:
    """Write an entry atomically (arrays first, description last); returns its description path,
    or None (with a warning) when the folder is not writable."""
    description = json.loads(json.dumps(description))
    key = description_key(description)
    desc_path, array_paths = _paths(cache_dir, key, description["kind"], list(arrays))
    # unique per writer: one builder per node may write the same entry on a shared filesystem,
    # where pids repeat across hosts; each rename is atomic and all writers' bytes are identical
    tag = f".tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        try:
            os.remove(desc_path)  # the entry is invalid until its description is back
        except FileNotFoundError:
            pass
        meta = {"description": description, "arrays": {}}
        for name, arr in arrays.items():
            with open(array_paths[name] + tag, "wb") as f:
                np.save(f, arr, allow_pickle=False)
            os.replace(array_paths[name] + tag, array_paths[name])
            meta["arrays"][name] = {
                "shape": list(arr.shape),
                "dtype": str(arr.dtype),
                "blake2b": _digest(arr),
            }
        with open(desc_path + tag, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        os.replace(desc_path + tag, desc_path)
    except OSError as e:
        for path in [*array_paths.values(), desc_path]:
            if os.path.exists(path + tag):
                os.remove(path + tag)
        logger.warning(
            "cannot write the index cache in %s (%s); pass --data-cache-path to a writable folder",
            cache_dir,
            e,
        )
        return None
    return desc_path


MEGATRON_ARRAYS = ("document_index", "sample_index", "shuffle_index")


def _megatron_mismatch(meg: dict, description: dict) -> str | None:
    """Why Megatron's description ``meg`` is not this GPTDataset's, or None when it is."""
    prefix = description["data"]["prefix"]
    path = meg.get("dataset_path")
    if not isinstance(path, str) or os.path.realpath(path) != os.path.realpath(prefix):
        return f"dataset_path {path} is not {prefix}"
    wanted = {
        "index_split": description["split"],
        "random_seed": description["seed"],
        "sequence_length": description["seq_length"],
        "num_samples": description["num_samples"],
    }
    for key, value in wanted.items():
        if meg.get(key) != value:
            return f"{key} {meg.get(key)} differs from this run's {value}"
    if meg.get("add_extra_token_to_sequence", True) is not True:
        return "add_extra_token_to_sequence is off (megalite's samples hold seq_length + 1 tokens)"
    return None


def _check_megatron_arrays(arrays: dict[str, np.ndarray], description: dict) -> None:
    lo, hi = description["documents"]
    doc, sample, shuffle = (arrays[k] for k in MEGATRON_ARRAYS)
    if doc.ndim != 1 or sample.ndim != 2 or sample.shape[1] != 2 or shuffle.ndim != 1:
        raise ValueError("array shapes are not Megatron's GPTDataset indices")
    if doc.size == 0 or int(doc.min()) != lo or int(doc.max()) != hi - 1:
        raise ValueError(f"its document index does not span this split's documents [{lo}, {hi})")
    if len(np.unique(doc)) != hi - lo:
        raise ValueError(f"its document index misses documents of [{lo}, {hi})")
    n = sample.shape[0] - 1
    if shuffle.size == 0 or int(shuffle.max()) >= n or int(shuffle.min()) < 0:
        raise ValueError(f"its shuffle index points outside its {n} samples")
    if int(sample[:, 0].max()) >= doc.size:
        raise ValueError("its sample index points past its document index")


def try_load_megatron(cache_dir: str, description: dict) -> dict[str, np.ndarray] | None:
    """Megatron-LM's index arrays for this GPTDataset (module docstring), or None."""
    suffix = f"-GPTDataset-{description['split']}-description.txt"
    try:
        names = sorted(n for n in os.listdir(cache_dir) if n.endswith(suffix))
    except OSError:
        return None
    for name in names:
        base = os.path.join(cache_dir, name[: -len("-description.txt")])
        try:
            with open(os.path.join(cache_dir, name), encoding="utf-8") as f:
                meg = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(meg, dict) or meg.get("class", "GPTDataset") != "GPTDataset":
            continue
        why = _megatron_mismatch(meg, description)
        if why is not None:
            if "dataset_path" not in why:  # Megatron's files for this data: say why not
                logger.warning("Megatron-LM index files %s-* not reused: %s", base, why)
            continue
        try:
            arrays = {
                k: np.asarray(np.load(f"{base}-{k}.npy", mmap_mode="r", allow_pickle=False))
                for k in MEGATRON_ARRAYS
            }
            _check_megatron_arrays(arrays, description)
        except (OSError, ValueError) as e:
            logger.warning("Megatron-LM index files %s-* not reused: %s", base, e)
            continue
        logger.info(
            "%s split: using Megatron-LM's index files %s-* (Megatron's sample order)",
            description["split"],
            base,
        )
        return arrays
    return None


def load_or_build(
    dirs: CacheDirs | None,
    description: dict,
    names: list[str],
    *,
    build: Callable[[], dict[str, np.ndarray]],
    write: bool,
) -> dict[str, np.ndarray]:
    """The arrays from a valid entry in one of ``dirs.read``, or ``build()`` them (and save them
    in ``dirs.write`` when ``write``); ``dirs`` None: build in memory.

    Ranks that do not write (``write=False``: they waited for a builder at a barrier) still build
    in memory when no valid entry is there, with a warning, rather than trust a bad one.
    """
    description = dict(description, cache_format=FORMAT_VERSION)
    read = dirs.read if dirs is not None else ()
    if description.get("kind") == "GPTDataset":
        for cache_dir in read:
            arrays = try_load_megatron(cache_dir, description)
            if arrays is not None:
                return arrays
    for cache_dir in read:
        arrays = try_load(cache_dir, description, names)
        if arrays is not None:
            logger.info("loaded %s indices from the cache in %s", description["kind"], cache_dir)
            return arrays
    if not write and dirs is not None and dirs.write is not None:
        logger.warning(
            "no valid %s index cache in %s after the barrier; building it in memory on this "
            "rank (build the cache on one rank per node, or share --data-cache-path)",
            description["kind"],
            dirs.write,
        )
    start = time.perf_counter()
    arrays = build()
    logger.info(
        "built %s indices (%s) in %.2f s",
        description["kind"],
        ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items()),
        time.perf_counter() - start,
    )
    if write and dirs is not None and dirs.write is not None:
        save(dirs.write, description, arrays)
    return arrays
