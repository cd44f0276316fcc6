"""On-disk cache of dataset index arrays, keyed by everything that determines them.

A cache entry is ``{key}-{kind}-{name}.npy`` per array plus ``{key}-{kind}-description.json``, where
``key`` is a hash of the *description* (a JSON dict: the data files' paths, sizes and modification
times, the documents used, seq_length, seed, sample count, weights, ...). The description file is
written last (renamed into place) and records each array's shape, dtype and blake2b digest; an entry
is used only when the description matches and every array checks out, so a stale, partial or
corrupt entry is rebuilt, never trusted.
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


def load_or_build(
    cache_dir: str | None,
    description: dict,
    names: list[str],
    *,
    build: Callable[[], dict[str, np.ndarray]],
    write: bool,
) -> dict[str, np.ndarray]:
    """The arrays from a valid cache entry, or ``build()`` them (and save them when ``write``).

    Ranks that do not write (``write=False``: they waited for a builder at a barrier) still build
    in memory when no valid entry is there, with a warning, rather than trust a bad one.
    """
    description = dict(description, cache_format=FORMAT_VERSION)
    if cache_dir is not None:
        arrays = try_load(cache_dir, description, names)
        if arrays is not None:
            logger.info("loaded %s indices from the cache in %s", description["kind"], cache_dir)
            return arrays
        if not write:
            logger.warning(
                "no valid %s index cache in %s after the barrier; building it in memory on this "
                "rank (build the cache on one rank per node, or share --data-cache-path)",
                description["kind"],
                cache_dir,
            )
    start = time.perf_counter()
    arrays = build()
    logger.info(
        "built %s indices (%s) in %.2f s",
        description["kind"],
        ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items()),
        time.perf_counter() - start,
    )
    if write and cache_dir is not None:
        save(cache_dir, description, arrays)
    return arrays
