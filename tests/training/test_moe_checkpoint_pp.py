"""A MoE checkpoint saved at one pipeline size resumes at another and continues with the
uninterrupted run's losses.

Layers are keyed by global layer index and experts by global layer and expert index
(``checkpoint.experts``: one file per pp x ep x etp rank), so a stage's experts reshard onto
whichever stage holds their layer now. On 4 ranks, iterations 1-4 of the real loop (``pretrain``),
saving at 2, then 3-4 resumed from iteration 2 at another layout:

- GPT-2 (MoE in every layer, both stages hold experts) saved at PP2 x EP2 (x DP2), resumed at
  PP1 x EP4 (x DP4) in the 4-rank world and at PP1 in one process;
- Llama (``--moe-layer-freq [0,1]``: only the last stage has experts; a gated shared expert)
  saved at PP1 x EP2 (x DP4), resumed at PP2 x EP2 (x DP2) and at PP1 in one process;
- the same Llama model with ZeRO-1 saved at PP2 x EP2, resumed at PP1 x EP2 with ZeRO-1 (the
  expert optimizer state resharded from edp 1 to edp 2).

Resumed losses = the uninterrupted run's iterations 3-4 within 1e-5 relative (the layout changed:
sums run in another order); without the optimizer state they differ (not vacuous).
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, MOE, assert_close_rel, config

REL = 1e-5
ITERS = ("--train-iters", "4")
ZERO = ("--use-distributed-optimizer",)


def _sizes(pp: int, ep: int) -> tuple[str, ...]:
    return ("--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep))


CASES = [  # (name, family, model flags, saved layout, resumed layout)
    ("gpt2-pp2-to-pp1", "gpt2", (), _sizes(2, 2), _sizes(1, 4)),
    ("llama-pp1-to-pp2", "llama", (), _sizes(1, 2), _sizes(2, 2)),
    ("llama-zero-pp2-to-pp1", "llama", ZERO, _sizes(2, 2), (*ZERO, *_sizes(1, 2))),
]


def _flags(family: str, model: tuple) -> list[str]:
    return [*FAMILIES[family], *MOE[family], *model, *ITERS]


def _save_and_resume_case(root: str) -> dict:
    """Per case: (the straight run's losses, the resumed run's), on this rank (last stage only)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for name, family, model, saved, resumed in CASES:
        save = ("--save", os.path.join(root, name), "--save-interval", "2")
        cfg = config(*_flags(family, model), *save, *saved, world_size=world, rank=rank)
        straight = pretrain(cfg, env=env).losses
        load = ("--load", os.path.join(root, name), "--ckpt-step", "2")
        again = pretrain(
            config(*_flags(family, ()), *load, *resumed, world_size=world, rank=rank), env=env
        ).losses
        out[name] = (straight, again)
    return out


def test_moe_checkpoint_resumes_at_another_pp_size():
    with tempfile.TemporaryDirectory() as root:
        _check(root, run_distributed(_save_and_resume_case, 4, root, timeout=600))


def _check(root: str, results: list[dict]) -> None:
    for name, family, _, _, _ in CASES:
        straight = [r[name][0] for r in results if r[name][0]]
        again = [r[name][1] for r in results if r[name][1]]
        assert straight and again, name
        want = straight[0]
        assert len(want) == 4 and max(want) - min(want) > 1e-4, (name, want)
        for got in again:
            assert_close_rel(got, want[2:], REL, f"{name}: resumed in the 4-rank world")
        load = ["--load", os.path.join(root, name), "--ckpt-step", "2"]
        single = pretrain(config(*_flags(family, ()), *load), env={}).losses
        assert_close_rel(single, want[2:], REL, f"{name}: resumed in one process")
    fresh = pretrain(config(*_flags(family, ()), *load, "--no-load-optim"), env={}).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(fresh, want[2:]))
    assert gap > 10 * REL, f"the optimizer state makes no difference ({gap}): vacuous"
