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


def resolve_prefixes(inputs: list[str]) -> list[str]:
    """A single folder -> the sorted prefixes of its .idx files; otherwise the prefixes as given."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(f[: -len(".idx")] for f in os.listdir(inputs[0]) if f.endswith(".idx"))
        if not names:
            raise ValueError(f"--input {inputs[0]}: no .idx files in this folder")
        return [os.path.join(inputs[0], n) for n in names]
    return list(inputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="a folder of shards, or prefixes")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        prefixes = resolve_prefixes(args.input)
        out = os.path.abspath(args.output_prefix)
        if any(os.path.abspath(x) == out for x in prefixes):
            raise ValueError(f"--output-prefix {args.output_prefix} is also an input; pick another")
        ds = merge_datasets(prefixes, args.output_prefix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
