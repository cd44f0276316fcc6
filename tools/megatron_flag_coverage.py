"""How many of Megatron-LM's flag uses ``pretrain_gpt.py`` accepts.

    python tools/megatron_flag_coverage.py MEGATRON_LM_CHECKOUT [--missing N]

Reads the flags of Megatron's GPT-3 and Llama example scripts
(``examples/gpt3/train_gpt3_175b_distributed.sh``, ``examples/llama/*.sh``) and of its GPT
functional-test configurations (``tests/functional_tests/test_cases/gpt/*/model_config.yaml``,
``MODEL_ARGS``; a ``false`` value is a flag not passed) and sorts every use into: implemented
(megalite's parser knows it and does what Megatron does), no-op (accepted with the one warning
line of ``megatron_flags.IGNORED_FLAGS``, each with the reason it changes no number), refused
(``megatron_flags.REFUSED_FLAGS``: one line saying why) and unknown (refused as unknown). Prints
the three counts apart, the share of uses accepted (implemented + no-op), and the most used
flags that are not implemented.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import re

from megalite.training.flags import build_parser
from megalite.training.megatron_flags import IGNORED_FLAGS, REFUSED_FLAGS

_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])")
# torchrun's own flags on the launch line of the scripts: not pretrain_gpt.py's
LAUNCHER = {
    *("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"),
    *("--nproc-per-node", "--node-rank", "--master-addr", "--master-port"),
}


def script_flags(path: str) -> list[str]:
    """The ``--flags`` of a shell script (comments dropped)."""
    flags = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0]
            flags += [f for f in _FLAG.findall(line) if f not in LAUNCHER]
    return flags


def yaml_flags(path: str) -> list[str]:
    """The flags of a functional test's ``MODEL_ARGS`` (a ``false`` value: not passed)."""
    import yaml  # PyYAML: only this tool needs it, for Megatron's test configurations

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    args = doc.get("MODEL_ARGS") or {}
    return [k for k, v in args.items() if k.startswith("--") and v is not False]


def sources(root: str) -> dict[str, list[str]]:
    out = {}
    gpt3 = os.path.join(root, "examples/gpt3/train_gpt3_175b_distributed.sh")
    llama = sorted(glob.glob(os.path.join(root, "examples/llama/*.sh")))
    for path in [gpt3, *llama]:
        if os.path.isfile(path):
            out[os.path.relpath(path, root)] = script_flags(path)
    pattern = os.path.join(root, "tests/functional_tests/test_cases/gpt/*/model_config.yaml")
    for path in sorted(glob.glob(pattern)):
        out[os.path.relpath(path, root)] = yaml_flags(path)
    return out


def is_inference(flags: list[str]) -> bool:
    """A functional test of Megatron's inference or RL entry points, not of pretrain_gpt.py."""
    return any(f.startswith(("--inference-", "--grpo-", "--rl-")) or f in INFERENCE for f in flags)


INFERENCE = {"--prompts", "--prompt-file", "--num-tokens-to-generate", "--perform-rl-step"}


@functools.cache
def _known_flags() -> frozenset[str]:
    return frozenset(build_parser()._option_string_actions)


KINDS = ("implemented", "no-op", "refused", "unknown")


def classify(flag: str) -> str:
    """One of ``KINDS``."""
    if flag in IGNORED_FLAGS:
        return "no-op"
    if flag in _known_flags():
        return "implemented"
    if flag in REFUSED_FLAGS:
        return "refused"
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("megatron_lm", help="a checkout of NVIDIA/Megatron-LM")
    parser.add_argument("--missing", type=int, default=25, help="list this many others")
    cli = parser.parse_args()
    everything = sources(cli.megatron_lm)
    training = {k: v for k, v in everything.items() if not is_inference(v)}
    print(f"all {len(everything)} sources:")
    report({k: v for k, v in everything.items()}, 0)
    others = len(everything) - len(training)
    print(
        f"\nthe {len(training)} pretraining sources (without {others} inference / RL tests, "
        "which run other entry points):"
    )
    report(training, cli.missing)


def report(found: dict[str, list[str]], missing: int) -> None:
    uses = collections.Counter(f for flags in found.values() for f in flags)
    kinds = {f: classify(f) for f in uses}
    by_kind = collections.Counter()
    for f, n in uses.items():
        by_kind[kinds[f]] += n
    total = sum(uses.values())
    accepted = by_kind["implemented"] + by_kind["no-op"]
    print(f"{len(found)} sources, {total} flag uses, {len(uses)} distinct flags")
    for kind in KINDS:
        distinct = sum(1 for f in uses if kinds[f] == kind)
        print(
            f"  {kind:12s} {by_kind[kind]:5d} uses ({100 * by_kind[kind] / total:.1f}%), "
            f"{distinct} flags"
        )
    print(f"accepted (implemented + no-op): {100 * accepted / total:.1f}% of uses")
    others = [(n, f, kinds[f]) for f, n in uses.most_common() if kinds[f] != "implemented"]
    for n, f, kind in others[:missing]:
        print(f"  {n:4d}  {f}  ({kind})")


if __name__ == "__main__":
    main()
