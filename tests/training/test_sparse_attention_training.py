"""Windowed and block-sparse attention in the real training loop against the single process.

Each layout runs 5 steps of the tiny model (seq 16, attention blocks of 6 tokens: the sequence is
not a multiple of the block) with a window or a sparse layout, and its losses and grad norms equal
those of ``ParallelState.single()`` with the same flags within 1e-5 relative (reduction order only).
The oracles themselves differ from plain causal attention, so the mask is in force.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.config import ConfigError
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-5
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
PP2 = ("--pipeline-model-parallel-size", "2")
BLOCK = ("--attention-block-size", "6")
WINDOW = ("--window-size", "5,0", *BLOCK)
LAYOUTS = [  # (family, layout flags, mask flags) on 4 ranks
    ("gpt2", TP2_SP, (*WINDOW, "--window-attn-skip-freq", "2")),  # layer 2 full
    ("llama", (*PP2, "--recompute-activations"), (*WINDOW, "--window-attn-skip-freq", "[0,1]")),
    ("llama", TP2_SP, (*BLOCK, "--sparse-attention", "bigbird", "--sparse-block-size", "2")),
    ("gpt2", PP2, (*BLOCK, "--sparse-attention", "fixed", "--sparse-block-size", "2")),
    ("gpt2", TP2_SP, (*BLOCK, "--sparse-attention", "longformer", "--sparse-block-size", "2")),
    ("llama", PP2, (*BLOCK, "--sparse-attention", "longformer", "--sparse-block-size", "2")),
    ("gpt2", PP2, (*BLOCK, "--sparse-attention", "bigbird", "--sparse-block-size", "2")),
    ("llama", TP2_SP, (*BLOCK, "--sparse-attention", "fixed", "--sparse-block-size", "2")),
]


def _run(family: str, flags: tuple, world: int = 1, rank: int = 0):
    cfg = config(*FAMILIES[family], *flags, world_size=world, rank=rank)
    par = cfg.parallel
    ps = (
        mesh(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
        if world > 1
        else ParallelState.single()
    )
    try:
        result = train_losses(cfg, ps)
    finally:
        if world > 1:
            ps.destroy()
    return ps.is_last_stage, result.losses, result.grad_norms


def _layouts_case(layouts) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {key: _run(key[0], key[1] + key[2], world=world, rank=rank) for key in layouts}


def test_window_and_sparse_layouts_match_single_process():
    results = run_distributed(_layouts_case, 4, LAYOUTS)
    plain = {family: _run(family, ())[1] for family in FAMILIES}
    for key in LAYOUTS:
        family, layout, flags = key
        _, losses, norms = _run(family, flags)
        assert losses != plain[family], f"{family} {flags}: the mask changes nothing"
        last = [r[key] for r in results if r[key][0]]
        assert last, key
        for _, got_losses, got_norms in last:
            what = f"{family} {' '.join(layout + flags)}"
            assert_close_rel(got_losses, losses, REL, f"{what} losses")
            assert_close_rel(got_norms, norms, REL, f"{what} grad norms")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--window-size", "4"), "--window-size: expected two integers LEFT,RIGHT, got '4'"),
        (("--window-attn-skip-freq", "2"), "--window-attn-skip-freq needs --window-size"),
        (
            ("--window-size", "4,0", "--window-attn-skip-freq", "[1,0,1]"),
            "--window-attn-skip-freq has 3 entries, need --num-layers 2 entries of 0 or 1",
        ),
        (("--window-size", "4,0", "--attention-dropout", "0.1"), "set --attention-dropout 0"),
        (
            ("--sparse-attention", "fixed", "--sparse-num-global-blocks", "9"),
            "0 <= --sparse-num-global-blocks <= --sparse-num-local-blocks, got 4 and 9",
        ),
        (("--sparse-attention", "dense"), "invalid choice: 'dense'"),
        (
            ("--sparse-attention", "fixed", "--attention-block-size", "0"),
            "--attention-block-size must be an integer >= 1, got 0",
        ),
    ],
)
def test_flag_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        config(*flags)
    assert "\n" not in str(e.value)
