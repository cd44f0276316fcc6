"""Context parallel composed with pipeline, tensor parallel and recomputation, in the real training
loop, against the single process.

On one 4-rank world, both families (GPT-2: learned positions, tied embedding; Llama: RoPE, GQA,
SwiGLU):

- CP2 a2a x PP2 (DP1): the a2a's head split around the core attention on each stage, the
  [s/cp, b, h] activations through the pipeline's p2p;
- CP2 all_gather x TP2, with and without sequence parallel;
- CP2 x DP2 with full recompute (uniform and block) and selective recompute, the comm types
  rotated over them (selective recomputes the core attention only under a2a: the ring and
  all_gather keep just q, k, v, the output and the log-sum-exp already).

The losses and grad norms of 3 iterations (two updates from the composed grads) equal those of
the same GPTModel on ``ParallelState.single()`` fed the whole global batch, within 1e-5 relative
(only the order of the softmax's, TP and DP/CP sums differs; measured <= 1.5e-7).

With dropout on (attention and hidden 0.1) no single process draws the ranks' masks (the ring's
and all_gather's come from a seed each rank draws from its tracker, ``test_attention_dropout``
checks them against unsplit attention), so the oracle there is the same CP2 run without
recompute: full and selective recomputation must replay every rank's masks (the ring's seed draw
included) and give its losses within 1e-6 relative, every comm type.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, config, train_losses

REL = 1e-5
DROPOUT_REL = 1e-6
CP2 = ("--context-parallel-size", "2")
PP2 = ("--pipeline-model-parallel-size", "2")
TP2 = ("--tensor-model-parallel-size", "2")
SP = ("--sequence-parallel",)
FULL_UNIFORM = tuple(
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
)
FULL_BLOCK = tuple(
    "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split()
)
SELECTIVE = ("--recompute-granularity", "selective")
ITERS = ("--train-iters", "3")  # two updates made from the composed grads reach the losses
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")


def _comm(kind: str) -> tuple[str, ...]:
    return ("--cp-comm-type", kind)


LAYOUTS = [  # (family, flags): the single process is the oracle
    ("gpt2", (*CP2, *PP2, *_comm("a2a"))),
    ("llama", (*CP2, *PP2, *_comm("a2a"))),
    ("gpt2", (*CP2, *TP2, *SP, *_comm("all_gather"))),
    ("llama", (*CP2, *TP2, *SP, *_comm("all_gather"))),
    ("llama", (*CP2, *TP2, *_comm("all_gather"))),
    ("gpt2", (*CP2, *FULL_UNIFORM, *_comm("p2p"))),
    ("llama", (*CP2, *FULL_UNIFORM, *_comm("all_gather"))),
    ("llama", (*CP2, *FULL_BLOCK, *_comm("a2a"))),
    ("gpt2", (*CP2, *SELECTIVE, *_comm("a2a"))),
    ("llama", (*CP2, *SELECTIVE, *_comm("a2a"))),
    ("gpt2", (*CP2, *SELECTIVE, *_comm("p2p"))),
]
DROPOUT_LAYOUTS = {  # (family, comm type): recompute variants against no recompute, dropout on
    ("gpt2", "p2p"): (FULL_UNIFORM,),
    ("llama", "p2p"): (FULL_BLOCK,),
    ("llama", "all_gather"): (FULL_UNIFORM,),
    ("gpt2", "a2a"): (FULL_UNIFORM, SELECTIVE),
}


def _train(family: str, flags: tuple, *, dropout: bool) -> tuple[bool, list, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(*FAMILIES[family], *flags, *ITERS, world_size=world, rank=rank)
    par = cfg.parallel
    ps = mesh(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        cp=par.context_parallel_size,
    )
    try:
        result = train_losses(cfg, ps, dropout_seeded=dropout)
    finally:
        ps.destroy()
    return ps.is_last_stage, result.losses, result.grad_norms


def _compositions_case(layouts, dropout_layouts) -> dict:
    out = {}
    for family, flags in layouts:
        out[(family, flags)] = _train(family, flags, dropout=False)
    for (family, kind), variants in dropout_layouts.items():
        for recompute in ((), *variants):
            flags = (*CP2, *_comm(kind), *DROPOUT, *recompute)
            out[("dropout", family, kind, recompute)] = _train(family, flags, dropout=True)
    return out


@functools.cache
def _oracle(family: str) -> tuple[list[float], list[float]]:
    result = train_losses(config(*FAMILIES[family], *ITERS), ParallelState.single())
    return result.losses, result.grad_norms


def _worst(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two runs' per-step numbers (inf if counts differ)."""
    if len(got) != len(want):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_cp_with_pp_tp_and_recompute_equal_single_process():
    results = run_distributed(_compositions_case, 4, LAYOUTS, DROPOUT_LAYOUTS, timeout=600)
    bad = []  # every layout that misses, so a failure names all of them
    for family, flags in LAYOUTS:
        losses, norms = _oracle(family)
        assert losses[-1] < losses[0], "the oracle does not train: the check is vacuous"
        last = [r[(family, flags)] for r in results if r[(family, flags)][0]]
        assert last, (family, flags)
        for _, got_losses, got_norms in last:
            worst = max(_worst(got_losses, losses), _worst(got_norms, norms))
            if not worst <= REL:
                bad.append(f"{family} {' '.join(flags)}: {worst:.2e}")
    for (family, kind), variants in DROPOUT_LAYOUTS.items():
        for r in results:
            _, ref, ref_norms = r[("dropout", family, kind, ())]
            # dropout is really on: the run without recompute is not the dropout-free one
            assert abs(ref[0] - _oracle(family)[0][0]) > 1e-4, (family, kind, ref)
            for recompute in variants:
                _, got, got_norms = r[("dropout", family, kind, recompute)]
                worst = max(_worst(got, ref), _worst(got_norms, ref_norms))
                if not worst <= DROPOUT_REL:
                    bad.append(f"{family} cp {kind} dropout {' '.join(recompute)}: {worst:.2e}")
    assert not bad, "relative differences past the tolerance:\n" + "\n".join(sorted(set(bad)))
