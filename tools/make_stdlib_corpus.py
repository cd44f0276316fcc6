r"""Write a jsonl corpus from the running Python's standard library: one document per ``.py`` file.

Usage:
    python tools/make_stdlib_corpus.py --output corpus.jsonl [--include-tests] [--max-mb 12] \
        [--exclude encodings pydoc_data]

Every Python installation carries this text, so the quickstart needs no download and commits no
data. Files are read in sorted path order (the same corpus on every run of one Python), as UTF-8
(files that are not are skipped); the test suites (``test/``, ``*/tests/``, ``idle_test``...) are
left out unless --include-tests, and so are ``site-packages`` and, by default, the top-level
folders ``encodings`` and ``pydoc_data`` (generated character tables and documentation strings,
not code; ``--exclude`` with no names keeps them). Each line is
``{"text": <the file>, "path": <its path under the library>}``. The work is in ``stdlib_documents``
and ``write_corpus``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from megalite.errors import ArgumentParser, DataError, UserError, path_problem, run_main

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
DEFAULT_EXCLUDE = ("encodings", "pydoc_data")


def stdlib_root() -> str:
    """The folder of this interpreter's pure-Python standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_documents(
    root: str | None = None,
    *,
    include_tests: bool = False,
    exclude: tuple[str, ...] | list[str] = DEFAULT_EXCLUDE,
) -> Iterator[tuple[str, str]]:
    """(relative path, text) of each ``.py`` file under ``root``, in sorted path order;
    ``exclude`` names top-level folders of ``root`` to leave out."""
    root = root or stdlib_root()
    for folder, dirs, files in os.walk(root):
        skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
        if folder == root:
            skip = skip | set(exclude)
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                yield os.path.relpath(path, root), text


def write_corpus(
    output: str,
    *,
    root: str | None = None,
    include_tests: bool = False,
    exclude: tuple[str, ...] | list[str] = DEFAULT_EXCLUDE,
    max_mb: float = 0.0,
) -> tuple[int, int]:
    """Write the jsonl; stop before exceeding ``max_mb`` megabytes of text (0: no limit).
    Returns (documents, bytes of text)."""
    limit = int(max_mb * 1e6) if max_mb else None
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    tmp = output + ".tmp"
    try:
        written = _write_documents(tmp, root, include_tests, exclude, limit)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)  # a full disk or Ctrl-C leaves no partial corpus
        raise
    docs, size = written
    if docs == 0:
        os.remove(tmp)
        raise DataError(f"no .py files found under {root or stdlib_root()} (--root)")
    os.replace(tmp, output)
    return docs, size


def _write_documents(tmp: str, root, include_tests, exclude, limit) -> tuple[int, int]:
    docs = size = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for rel, text in stdlib_documents(root, include_tests=include_tests, exclude=exclude):
            n = len(text.encode("utf-8"))
            if limit is not None and size + n > limit:
                break
            out.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
            docs += 1
            size += n
    return docs, size


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output", required=True, help="the .jsonl to write")
    p.add_argument("--root", help="library folder (default: this Python's standard library)")
    p.add_argument("--include-tests", action="store_true", help="keep the test suites too")
    p.add_argument(
        "--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), help="top-level folders to skip"
    )
    p.add_argument("--max-mb", type=float, default=0.0, help="stop at this many MB of text")
    args = p.parse_args(argv)
    try:
        docs, size = write_corpus(
            args.output,
            root=args.root,
            include_tests=args.include_tests,
            exclude=args.exclude,
            max_mb=args.max_mb,
        )
    except OSError as e:
        raise UserError(
            f"--output {args.output}: cannot write ({path_problem(e)}); choose a writable path"
        ) from None
    print(
        f"wrote {docs} documents ({size / 1e6:.1f} MB) from {args.root or stdlib_root()} "
        f"to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
