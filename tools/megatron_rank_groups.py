"""Write the fixtures of the groups Megatron-core's RankGenerator builds (tests/fixtures/).

    pip install --no-deps --target /tmp/mcore megatron-core      # not a dependency of megalite
    PYTHONPATH=/tmp/mcore python tools/megatron_rank_groups.py [--output P] [--expert-output P]

``megatron_rank_groups.json``: for every combination of axis sizes in {1, 2, 3, 4, 8} whose product
is at most 64 (CP or EP above 1, not both: Megatron builds the dense and the expert view
separately), both orders megalite's tests check (``tp-cp-ep-dp-pp`` and ``tp-cp-ep-pp-dp``), and
every axis combination megalite builds, one digest of
``{token: RankGenerator(...).get_ranks(token)}`` over the tokens (JSON with sorted keys, sha256,
16 hex digits), so the fixture stays small and the comparison exact:
``tests/core/test_mesh_layout.py`` computes the same digest from ``rank_groups``.

``megatron_expert_rank_groups.json``: the expert view as ``initialize_model_parallel`` builds it,
for every dense layout (tp, cp, dp, pp: any sizes, product at most 64) with EP and ETP in {1, 2, 4}
that factors the world, in both orders: whether Megatron accepts the layout (its two assertions:
with PP > 1 and pp not last the expert DP size equals the dense one, and the dense and the expert
generator's ``pp`` groups are equal) and the expert generator's groups
(``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1)``, tokens ``EXPERT_TOKENS``); one digest per
order and world over its layouts (``expert_entry``), with the counts of layouts and refusals.
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
EXPERT_TOKENS = ("tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp")
EXPERT_SIZES = (1, 2, 4)  # EP and ETP


def dense_layouts(world: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, cp, dp, pp) whose product is ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [
        (tp, cp, dp, world // (tp * cp * dp))
        for tp in divisors
        for cp in divisors
        for dp in divisors
        if world % (tp * cp * dp) == 0
    ]


def expert_layouts(world: int) -> list[tuple[int, int, int, int, int, int]]:
    """Every (tp, cp, dp, pp, ep, etp) of ``world`` with EP, ETP in ``EXPERT_SIZES`` that factors
    the expert view (etp x ep x pp divides the world)."""
    return [
        (tp, cp, dp, pp, ep, etp)
        for tp, cp, dp, pp in dense_layouts(world)
        for ep in EXPERT_SIZES
        for etp in EXPERT_SIZES
        if world % (etp * ep * pp) == 0
    ]


def expert_entry(records: dict[str, list]) -> dict:
    """The fixture's entry of one (order, world): ``records`` maps "tp,cp,dp,pp,ep,etp" to
    [accepted, {token: groups}]."""
    text = json.dumps(records, sort_keys=True).encode()
    return {
        "layouts": len(records),
        "refused": sum(1 for accepted, _ in records.values() if not accepted),
        "digest": hashlib.sha256(text).hexdigest()[:16],
    }


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
    parser.add_argument(
        "--expert-output", default=default.replace("rank_groups", "expert_rank_groups")
    )
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

    expert = {}
    for order in ORDERS:
        for world in range(1, 65):
            records = {}
            for tp, cp, dp, pp, ep, etp in expert_layouts(world):
                edp = world // (etp * ep * pp)
                dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
                gen = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
                accepted = (order.endswith("pp") or pp == 1 or edp == dp) and dense.get_ranks(
                    "pp"
                ) == gen.get_ranks("pp")
                groups = {t: gen.get_ranks(t) for t in EXPERT_TOKENS}
                records[",".join(map(str, (tp, cp, dp, pp, ep, etp)))] = [accepted, groups]
            expert[f"{order}|{world}"] = expert_entry(records)
    with open(args.expert_output, "w") as f:
        json.dump(expert, f, indent=0, sort_keys=True)
    total = sum(e["layouts"] for e in expert.values())
    refused = sum(e["refused"] for e in expert.values())
    print(f"{total} expert layouts ({refused} refused) -> {args.expert_output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
