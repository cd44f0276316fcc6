"""Fail when the code records its own history: a reference to an issue number.

    python tools/check_history.py          # exit 1 and one line per reference found, else exit 0
    python tools/check_history.py --root DIR

The code says what a thing is and why; which issue brought it lives in git. Checked: megalite/,
tools/, scripts/, pretrain_gpt.py and the README's headings. ``scripts/test.sh`` runs this before
the tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PATHS = ("megalite", "tools", "scripts", "pretrain_gpt.py")
SUFFIXES = {".py", ".sh", ".sbatch", ".md", ".toml", ".txt", ".cfg"}
# "issue" (any case, plural, an optional #) before a number, or ISSUE_ and a number
REFERENCE = re.compile(r"\b[Ii]ssues? #?\d+|\bISSUE_\d+")
SELF = Path(__file__).name  # this file names the pattern it looks for


def references(root: Path) -> list[str]:
    """``path:line: text`` for every issue-number reference under ``root``'s checked paths."""
    found = []
    files = []
    for name in PATHS:
        path = root / name
        files += sorted(path.rglob("*")) if path.is_dir() else [path] if path.exists() else []
    for path in files:
        if path.suffix not in SUFFIXES or path.name == SELF or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if REFERENCE.search(line):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    readme = root / "README.md"
    if readme.exists():
        for n, line in enumerate(readme.read_text().splitlines(), 1):
            if line.startswith("#") and REFERENCE.search(line):
                found.append(f"README.md:{n}: {line.strip()}")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = p.parse_args(argv)
    found = references(args.root)
    for line in found:
        print(line)
    if found:
        print(
            f"{len(found)} issue-number reference(s): say what the code is and why, "
            "not which issue brought it (git keeps that)",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
