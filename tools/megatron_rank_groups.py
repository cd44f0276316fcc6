"""Write the fixture of the groups Megatron-core's RankGenerator builds (tests/fixtures/).

    pip install --no-deps --target /tmp/mcore megatron-core      # not a dependency of megalite
    PYTHONPATH=/tmp/mcore python tools/megatron_rank_groups.py [--output PATH]

For every combination of axis sizes in {1, 2, 3, 4, 8} whose product is at most 64 (CP or EP
above 1, not both: Megatron builds the dense and the expert view separately), both orders
megalite's tests check (``tp-cp-ep-dp-pp`` and ``tp-cp-ep-pp-dp``), and every axis combination
megalite builds, it records one digest of ``{token: RankGenerator(...).get_ranks(token)}`` over
the tokens (JSON with sorted keys, sha256, 16 hex digits), so the fixture stays small and the
comparison exact: ``tests/core/test_mesh_layout.py`` computes the same digest from ``rank_groups``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys

from megalite.errors import ArgumentParser, UserError, run_main

SIZES = (1, 2, 3, 4, 8)
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
TOKENS = ("tp", "cp", "ep", "dp", "pp", "tp-cp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-ep", "tp-ep-pp")


def digest(groups_by_token: dict[str, list[list[int]]]) -> str:
    return hashlib.sha256(json.dumps(groups_by_token, sort_keys=True).encode()).hexdigest()[:16]


def key(sizes: dict[str, int], order: str) -> str:
    return f"{order}|" + ",".join(f"{a}{sizes[a]}" for a in ("tp", "cp", "ep", "dp", "pp"))


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "tests", "fixtures", "megatron_rank_groups.json")
    parser.add_argument("--output", default=default)
    args = parser.parse_args(argv)
    try:
        from megatron.core.parallel_state import RankGenerator
    except ImportError:
        raise UserError(
            "megatron-core is not importable; see this tool's docstring (pip install --target)"
        ) from None

    out = {}
    for tp, cp, ep, dp, pp in itertools.product(SIZES, repeat=5):
        if tp * cp * ep * dp * pp > 64 or (cp > 1 and ep > 1):
            continue  # Megatron's generators hold CP (dense view) or EP (expert view), not both
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for order in ORDERS:
            gen = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
            out[key(sizes, order)] = digest({t: gen.get_ranks(t) for t in TOKENS})
    with open(args.output, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"{len(out)} digests -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
