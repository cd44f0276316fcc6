"""Context parallel in the real training loop against the single process.

Both families (GPT-2: learned positions, tied embedding; Llama: RoPE, GQA, SwiGLU): CP2 x DP2 and
CP2 x TP2 (sequence parallel) on 4 ranks, CP2 x PP2 x DP2 on 8, the comm types rotated over them
and ZeRO-1 in two: the 5 losses
and grad norms equal those of the same GPTModel on ``ParallelState.single()`` fed the whole global
batch, within 1e-5 relative (only the order of the softmax, DP/CP and TP sums differs; measured
~1e-7). Each cp rank reads its replica's micro-batches and keeps its chunks; the loss is the mean
over every token of the sequence, the grads are averaged over dp x cp.
Also: a checkpoint saved at CP2 resumes at CP1 with the uninterrupted run's losses, and the
one-line errors of the context-parallel flags.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import (
    BASE,
    FAMILIES,
    LogCapture,
    assert_close_rel,
    config,
    train_losses,
)

REL = 1e-5
CP2 = ("--context-parallel-size", "2")
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
PP2 = ("--pipeline-model-parallel-size", "2")
ZERO = ("--use-distributed-optimizer",)


def _oracle(family: str) -> tuple[list[float], list[float]]:
    result = train_losses(config(*FAMILIES[family]), ParallelState.single())
    return result.losses, result.grad_norms


def _layouts_case(layouts, save: str) -> dict:
    """Every rank: (is_last_stage, losses, grad norms) per (family, flags); on 4 ranks the first
    layout saves its iteration 3 to ``save``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (family, flags) in enumerate(layouts):
        if i == 0 and world == 4:  # pretrain_gpt.py's path (mesh from the flags), saves iter 3
            saving = ("--save", save, "--save-interval", "3")
            cfg = config(*FAMILIES[family], *flags, *saving, world_size=world, rank=rank)
            with LogCapture() as logs:
                result = pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": str(world)})
            out[(family, flags)] = (True, result.losses, result.grad_norms)  # PP 1: all last
            out["log"] = [line for line in logs.lines if line.startswith("megalite: world")]
            continue
        cfg = config(*FAMILIES[family], *flags, world_size=world, rank=rank)
        par = cfg.parallel
        ps = mesh(
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            cp=par.context_parallel_size,
        )
        try:
            result = train_losses(cfg, ps)
        finally:
            ps.destroy()
        out[(family, flags)] = (ps.is_last_stage, result.losses, result.grad_norms)
    return out


LAYOUTS = {  # world size -> layouts; comm types rotated (a2a x TP: heads / tp / cp); ZeRO-1 in two
    4: [
        ("gpt2", (*CP2, "--cp-comm-type", "p2p")),  # CP2 x DP2, through pretrain(), saves
        ("llama", (*CP2, "--cp-comm-type", "a2a")),
        ("llama", (*CP2, *TP2_SP, *ZERO, "--cp-comm-type", "a2a")),
        ("gpt2", (*CP2, *TP2_SP, "--cp-comm-type", "p2p")),
    ],
    8: [
        ("gpt2", (*CP2, *PP2, "--cp-comm-type", "all_gather")),
        ("llama", (*CP2, *PP2, *ZERO, "--cp-comm-type", "p2p")),
    ],
}


def test_cp_layouts_match_single_process_and_resume_at_cp1():
    oracles = {family: _oracle(family) for family in FAMILIES}
    first = LAYOUTS[4][0][0]
    with tempfile.TemporaryDirectory() as root:
        save = os.path.join(root, "cp2")
        results = {w: run_distributed(_layouts_case, w, LAYOUTS[w], save) for w in LAYOUTS}
        # CP shards no parameter: the CP2 x DP2 checkpoint of iteration 3 goes on at CP1 x DP1
        resumed = pretrain(config(*FAMILIES[first], "--load", save, "--ckpt-step", "3"), env={})
    assert resumed.iteration == 5
    logged = [line for r in results[4] for line in r["log"]]
    assert any("world 4 = TP 1 x CP 2 (p2p) x PP 1 x DP 2 on cpu" in line for line in logged), (
        logged
    )
    assert_close_rel(resumed.losses, oracles[first][0][3:], REL, "resumed at CP1")
    for world, layouts in LAYOUTS.items():
        for family, flags in layouts:
            losses, norms = oracles[family]
            assert losses[-1] < losses[0], "the oracle does not train: the check is vacuous"
            last = [r[(family, flags)] for r in results[world] if r[(family, flags)][0]]
            assert last, (family, flags)
            for _, got_losses, got_norms in last:
                what = f"{family} {' '.join(flags)} on {world} ranks"
                assert_close_rel(got_losses, losses, REL, f"{what} losses")
                assert_close_rel(got_norms, norms, REL, f"{what} grad norms")


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (("--context-parallel-size", "3"), 3, "--seq-length 16 is not divisible by 2 x "
         "--context-parallel-size 3 = 6"),
        (("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--cp-comm-type",
          "a2a", "--num-attention-heads", "2", "--hidden-size", "32"), 4,
         "--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 2 x "
         "--context-parallel-size 2 = 4"),
        (("--context-parallel-size", "2"), 3, "world size 3 is not divisible by"),
        (("--context-parallel-size", "0"), 1, "--context-parallel-size must be an integer >= 1"),
    ],
)  # fmt: skip
def test_cp_flag_errors(flags, world, message):
    env = {"RANK": "0", "WORLD_SIZE": str(world)}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as e:
        parse_args([*BASE, *flags], env=env)
    assert "\n" not in str(e.value)
