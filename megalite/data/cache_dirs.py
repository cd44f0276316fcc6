"""Where the dataset caches live: the folders read, and the one folder written.

``--data-cache-path D`` puts every cache in ``D``. Without it a cache lives beside the data, as in
Megatron-LM (``dirname(prefix)/cache/GPTDataset_indices``). When that folder cannot be written (a
read-only data folder, another user's data) the caches go to a per-user folder instead,
``$XDG_CACHE_HOME/megalite/<data folder's name>-<hash of its absolute path>/`` (``~/.cache`` when
``XDG_CACHE_HOME`` is unset), one per data folder, so two datasets never share an entry and later
runs find what the first one built rather than rebuild it; one warning line says so. The folder
beside the data is still read first: caches built there before it became read-only (Megatron's
index files included) are used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheDirs:
    """``read``: folders looked in for a valid entry, in order; ``write``: where a built entry is
    saved (None: no folder this process can write, so each run builds in memory)."""

    read: tuple[str, ...]
    write: str | None


def user_cache_root() -> str:
    """``$XDG_CACHE_HOME/megalite``, or ``~/.cache/megalite``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megalite")


def user_cache_dir(beside: str) -> str:
    """The per-user stand-in for ``beside`` (``<data folder>/cache/<kind>_indices``): the data
    folder's name and a hash of its absolute path, then the same ``<kind>_indices`` leaf."""
    beside = os.path.abspath(beside)
    data_dir = os.path.dirname(os.path.dirname(beside))
    digest = hashlib.sha256(data_dir.encode()).hexdigest()[:16]
    name = os.path.basename(data_dir) or "root"
    return os.path.join(user_cache_root(), f"{name}-{digest}", os.path.basename(beside))


def can_write(folder: str) -> bool:
    """Whether this process can create ``folder`` (if missing) and files in it: a probe file is
    created and removed in ``folder`` or, when it does not exist yet, in its nearest existing
    parent. A real write, not the permission bits: read-only mounts and immutable folders refuse
    it even for root."""
    probe_dir = os.path.abspath(folder)
    while not os.path.isdir(probe_dir):
        if os.path.exists(probe_dir):  # a file where a folder should be
            return False
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            return False
        probe_dir = parent
    probe = os.path.join(probe_dir, f".megalite-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb"):
            pass
    except OSError:
        return False
    try:
        os.remove(probe)
    except OSError:
        pass
    return True


def resolve(cache_dir: str | None, *, beside: str, warn: bool = True) -> CacheDirs:
    """The folders for a cache: ``cache_dir`` (``--data-cache-path``) when given, else ``beside``
    the data when writable, else the per-user folder (module docstring; ``warn``: say so, once per
    data folder per process: on the ranks that write)."""
    if cache_dir:
        return CacheDirs((cache_dir,), cache_dir if can_write(cache_dir) else None)
    if can_write(beside):
        return CacheDirs((beside,), beside)
    fallback = user_cache_dir(beside)
    writable = can_write(fallback)
    if warn:
        _warn_read_only(
            os.path.dirname(os.path.dirname(os.path.abspath(beside))), fallback, writable
        )
    return CacheDirs((beside, fallback), fallback if writable else None)


@functools.cache
def _warn_read_only(data_dir: str, fallback: str, writable: bool) -> None:
    """One line per data folder and process: several caches resolve the same folder."""
    if writable:
        logger.warning(
            "the data folder %s is not writable: caching its token-id ranges and dataset indices "
            "in %s (pass --data-cache-path to choose the folder)",
            data_dir,
            os.path.dirname(fallback),
        )
    else:
        logger.warning(
            "neither the data folder %s nor %s is writable: the token-id ranges and dataset "
            "indices are rebuilt every run; pass --data-cache-path to a writable folder",
            data_dir,
            os.path.dirname(fallback),
        )
