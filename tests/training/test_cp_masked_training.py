"""Context parallelism under windows, block-sparse layouts and packed documents against the single
process.

CP2 on 2 ranks (p2p: the block-sparse ring; a2a: block-sparse attention over the gathered
sequence), both families, 5 steps of 4 micro-batches of 2 samples x 16 tokens with eods inside
(``--reset-attention-mask --reset-position-ids``) and/or a window, attention blocks of 3 tokens
(the chunks of 4 tokens are not multiples): every rank's losses and grad norms equal the single
process fed the same micro-batches within 1e-5 relative (reduction order only). Each cp rank keeps
its chunks of the tokens and derives its chunks' document boundaries from the whole sequence's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.data.samplers import GPTBatchCollator
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, trainer_and_data

REL = 1e-5
EOD = 127  # NullTokenizer --vocab-size 127
STEPS, PER_STEP = 5, 4
DOCS = ("--reset-attention-mask", "--reset-position-ids")
WINDOW = ("--window-size", "4,0")
BLOCK = ("--attention-block-size", "3")


def _micro_batches(docs: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    collate = GPTBatchCollator(
        eod=EOD, eod_mask_loss=False, reset_position_ids=docs, reset_attention_mask=docs
    )
    out = []
    for _ in range(STEPS * PER_STEP):
        samples = [rng.integers(0, EOD, 17) for _ in range(2)]
        for s in samples:
            s[rng.integers(1, 15, 2)] = EOD
        out.append(collate(samples))
    return out


def _train(flags: tuple, world: int, rank: int) -> tuple[bool, list[float], list[float]]:
    cfg = config(*flags, world_size=world, rank=rank)
    ps = mesh(1, 1, cp=world) if world > 1 else ParallelState.single()
    try:
        trainer, _ = trainer_and_data(cfg, ps)
        data = iter(_micro_batches(cfg.data.reset_attention_mask))
        forward = make_forward_step(torch.device("cpu"))
        results = [trainer.step(forward, [data]) for _ in range(STEPS)]
    finally:
        if world > 1:
            ps.destroy()
    losses = [float(r.losses["lm loss"]) for r in results]
    return ps.is_last_stage, losses, [float(r.grad_norm) for r in results]


SPARSE = ("--sparse-block-size", "2", "--sparse-attention")
CASES = [  # (family, cp_comm_type, mask flags)
    ("gpt2", "p2p", WINDOW),
    ("llama", "p2p", DOCS),
    ("llama", "p2p", (*DOCS, *WINDOW)),
    ("gpt2", "a2a", (*DOCS, *WINDOW)),
    ("llama", "p2p", (*SPARSE, "bigbird")),
    ("gpt2", "a2a", (*SPARSE, "fixed")),
    ("gpt2", "p2p", (*SPARSE, "longformer", *DOCS)),
    ("llama", "a2a", (*SPARSE, "longformer")),
    ("gpt2", "p2p", (*WINDOW, "--window-attn-skip-freq", "2")),
    ("llama", "a2a", (*WINDOW, "--window-attn-skip-freq", "[1,0]")),
]


def _case(cases) -> dict:
    rank = dist.get_rank()
    out = {}
    for family, comm, flags in cases:
        cp = ("--context-parallel-size", "2", "--cp-comm-type", comm)
        out[(family, comm, flags)] = _train((*FAMILIES[family], *BLOCK, *flags, *cp), 2, rank)
    return out


@pytest.mark.parametrize("part", range(5))
def test_cp2_masks_and_documents_match_single_process(part):
    cases = CASES[2 * part : 2 * part + 2]
    results = run_distributed(_case, 2, cases)
    for key in cases:
        family, _, flags = key
        _, losses, norms = _train((*FAMILIES[family], *BLOCK, *flags), 1, 0)
        _, plain, _ = _train(tuple(FAMILIES[family]), 1, 0)
        assert losses != plain, f"{key}: the mask changes nothing"
        for r in results:
            what = " ".join((family, *key[1:2], *flags))
            assert_close_rel(r[key][1], losses, REL, f"{what} losses")
            assert_close_rel(r[key][2], norms, REL, f"{what} grad norms")
