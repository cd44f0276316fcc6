"""User errors: the one place that turns them into one line and an exit status.

A *user error* is anything the user can fix by changing a flag, a file or a folder. megalite raises
it as a ``UserError`` (``ConfigError``, ``IndexedDatasetError``, ``CheckpointError``,
``ConversionError``, ``PreprocessError``, ``DataError``, ``TokenizerError`` subclass it) whose
message is one line naming the flag or file, the numbers, and the fix. Exceptions that libraries
raise for bad files (SentencePiece, gzip, json, ``OSError`` for paths) are translated into one where
megalite calls them (``path_problem`` words an ``OSError``). Every entry point runs its ``main``
under ``run_main``::

    if __name__ == "__main__":
        sys.exit(run_main(main))

which prints ``error: <message>`` on stderr and returns the error's ``exit_code``; anything else (a
bug in megalite) propagates with its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence


class UserError(Exception):
    """Something the user can fix; the message is one line naming the flag or file."""

    exit_code = 1


class UsageError(UserError):
    """A bad command line (unknown flag, missing or malformed value)."""

    exit_code = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the tools: a bad command line is a ``UsageError`` (one line, status 2),
    not usage text."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


class ConfigError(UserError, ValueError):
    """A bad setting or combination of a run's configuration (``megalite.training.config``); the
    message is one line, ready to print after ``error: ``."""

    exit_code = 2


def at_least(low: float, *named: tuple[str, float | None]) -> None:
    """ConfigError naming the first ``(name, value)`` below ``low`` (None: unset, skipped)."""
    for name, value in named:
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")


class DataError(UserError, ValueError):
    """Data that cannot be trained on (an empty split, token ids outside the vocabulary)."""


def one_line(message: str) -> str:
    """``message`` on one line: its lines joined with ``; ``."""
    lines = [x.strip() for x in str(message).splitlines() if x.strip()]
    return "; ".join(lines) if lines else "(no message)"


_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "is a folder, not a file",
    errno.EEXIST: "exists already",
}


def path_problem(e: OSError) -> str:
    """A few words for an ``OSError`` on a path: its reason, without the path (the caller names
    the path and the flag)."""
    if e.errno in _REASONS:
        return _REASONS[e.errno]
    return (e.strerror or str(e) or type(e).__name__).strip().lower()


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_writable_dir(path: str, *, flag: str, what: str = "output") -> None:
    """Refuse (``UserError``) a folder this process cannot create or write a file in: creates the
    folder (and its parents) as the run would, writes and removes a probe file. A folder it had to
    create is left empty."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise UserError(
            f"{flag} {path}: is a file, not a folder; give a folder for the {what}"
        ) from None
    except OSError as e:
        raise UserError(
            f"{flag} {path}: cannot create the folder ({path_problem(e)} at "
            f"{_nearest_existing(path)}); give a writable folder for the {what}"
        ) from None
    probe = os.path.join(path, f".megalite-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
    except OSError as e:
        raise UserError(
            f"{flag} {path}: cannot write in this folder ({path_problem(e)}); give a writable "
            f"folder for the {what}"
        ) from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def read_error(path: str, e: Exception, *, line: int, flag: str = "--input") -> UserError:
    """The one-line error for a library's exception while reading ``path`` after ``line`` lines:
    a truncated or corrupt ``.gz`` (EOFError, BadGzipFile, zlib.error) or an OSError."""
    if isinstance(e, EOFError):
        what = "truncated gzip file (the compressed stream ends early)"
    elif isinstance(e, OSError) and e.errno is None:  # gzip.BadGzipFile
        what = f"not a readable gzip file ({one_line(str(e))})"
    elif isinstance(e, OSError):
        what = f"cannot read ({path_problem(e)})"
    else:
        what = f"corrupt compressed data ({one_line(str(e))})"
    return UserError(f"{flag} {path}: {what} after line {line}; re-create or re-download the file")


def _rank_prefix(env: Mapping[str, str]) -> str:
    """``"rank N: "`` in a multi-process launch (torchrun or srun), else ``""``."""
    world = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS")
    rank = env.get("RANK") or env.get("SLURM_PROCID")
    if world and rank and world.isdigit() and int(world) > 1:
        return f"rank {rank}: "
    return ""


def report(e: BaseException, *, env: Mapping[str, str] | None = None, file=None) -> None:
    """Print ``error: <one line>`` for ``e`` on ``file`` (stderr)."""
    prefix = _rank_prefix(os.environ if env is None else env)
    print(f"error: {prefix}{one_line(str(e))}", file=file or sys.stderr, flush=True)


def run_main(
    main: Callable[[Sequence[str] | None], int | None],
    argv: Sequence[str] | None = None,
    *,
    user_errors: Mapping[type[BaseException], int] | None = None,
) -> int:
    """Run ``main(argv)`` and return its exit status: 0 when it returns None. A ``UserError`` (or
    one of the extra ``user_errors`` classes, mapped to their status) prints one line and returns
    its ``exit_code``; Ctrl-C returns 130 quietly; anything else propagates with its traceback."""
    extra = dict(user_errors or {})
    try:
        status = main(argv)
    except UserError as e:
        report(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except tuple(extra) as e:  # noqa: B030 - the classes the entry point names
        report(e)
        return next(code for cls, code in extra.items() if isinstance(e, cls))
    return 0 if status is None else int(status)
