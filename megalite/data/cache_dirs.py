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


def _nearest_folder(folder: str) -> str | None:
    """``folder`` or its nearest existing parent; None when a file stands in the way."""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if os.path.exists(folder) or parent == folder:  # a file where a folder should be
            return None
        folder = parent
    return folder


def can_write(folder: str, *, probe: bool = True) -> bool:
    """Whether this process can create ``folder`` (if missing) and files in it. ``probe``: by a
    real write (a file created and removed in ``folder``, or its nearest existing parent), which
    read-only mounts and immutable folders refuse even for root; else by ``os.access`` alone, for
    the ranks that only read (no file created by every rank of a job)."""
    existing = _nearest_folder(folder)
    if existing is None:
        return False
    if not probe:
        return os.access(existing, os.W_OK | os.X_OK)
    path = os.path.join(existing, f".megalite-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(path, "wb"):
            pass
    except OSError:
        return False
    try:
        os.remove(path)
    except OSError:
        pass
    return True


def resolve(cache_dir: str | None, *, beside: str, writer: bool = True) -> CacheDirs:
    """The folders for a cache: ``cache_dir`` (``--data-cache-path``) when given, else ``beside``
    the data when writable, else the per-user folder (module docstring). ``writer``: this rank
    writes the caches: it probes by writing and says (once per data folder and process) that it
    uses the per-user folder; the other ranks only ask ``os.access``, and read both folders (the
    writer's probe may have found what ``os.access`` did not)."""
    if cache_dir:
        return CacheDirs((cache_dir,), cache_dir if can_write(cache_dir, probe=writer) else None)
    fallback = user_cache_dir(beside)
    if can_write(beside, probe=writer):
        return CacheDirs((beside,) if writer else (beside, fallback), beside)
    writable = can_write(fallback, probe=writer)
    if writer:
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
