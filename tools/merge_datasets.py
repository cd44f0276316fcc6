"""Concatenate indexed-dataset shards into one dataset (same dtype), written atomically.

Usage:
    python tools/merge_datasets.py --input shards/ --output-prefix data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix data/ab

With a folder, every PREFIX.idx in it (with its PREFIX.bin) is merged in sorted name order;
otherwise the prefixes given, in the order given. The work is in
megalite.data.indexed_dataset.merge_datasets.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megalite.data.indexed_dataset import merge_datasets
from megalite.errors import ArgumentParser, UserError, check_writable_dir, path_problem, run_main


def resolve_prefixes(inputs: list[str]) -> list[str]:
    """A single folder -> the sorted prefixes of its .idx files; otherwise the prefixes as given."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(f[: -len(".idx")] for f in os.listdir(inputs[0]) if f.endswith(".idx"))
        if not names:
            raise UserError(f"--input {inputs[0]}: no .idx files in this folder")
        return [os.path.join(inputs[0], n) for n in names]
    return list(inputs)


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="a folder of shards, or prefixes")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    prefixes = resolve_prefixes(args.input)
    out = os.path.abspath(args.output_prefix)
    if any(os.path.abspath(x) == out for x in prefixes):
        raise UserError(f"--output-prefix {args.output_prefix} is also an input; pick another")
    folder = os.path.dirname(out)
    check_writable_dir(folder, flag="--output-prefix", what="merged dataset")
    try:
        ds = merge_datasets(prefixes, args.output_prefix)
    except OSError as e:  # writing the output (the inputs are checked as IndexedDatasetErrors)
        raise UserError(
            f"--output-prefix {args.output_prefix}: cannot write ({path_problem(e)}); nothing was "
            "kept; free space or choose another folder"
        ) from None
    logging.info(
        "merged %d datasets into %s: %d documents, %d tokens",
        len(prefixes),
        args.output_prefix,
        ds.num_documents,
        ds.num_tokens,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
