"""MoE under context parallelism in the real training loop against the single process (fp32).

The MoE contract (DESIGN §8): the gradient equals the single-device global-batch gradient,
auxiliary losses included, whatever CP. Under CP a micro-batch's tokens are spread over the cp
ranks: the router statistics are summed over tp x cp and each rank's part of the aux and z losses
is multiplied by ``cp_size`` against the dp x cp grad average (``core.moe.aux_loss``).

On 4 ranks, CP2 x DP2 and CP2 x EP2 (expert view: edp 2 folded over cp), both families (GPT-2:
GELU experts, the alltoall dispatcher; Llama: SwiGLU experts, a gated shared expert, the allgather
dispatcher), the ring and a2a attention, ``aux_loss``, ``seq_aux_loss`` and ``global_aux_loss``
with large coefficients (a mis-scaled aux or z grad moves the grads well past the tolerance):

- the first step's gradient of every parameter (experts by global index) equals the oracle's,
  |g - g_oracle| / |g_oracle| < 1e-5 per tensor (``--clip-grad 0``, so the grads read after the
  step are the synced ones, unclipped);
- the 5 losses, the load-balancing and z losses (``TrainResult.moe_losses``) and the grad norms
  equal the oracle's within 1e-5 relative.

The oracle is the same model on ``ParallelState.single()`` fed the whole global batch (same
micro-batch size; for ``global_aux_loss`` the micro-batch is the data-parallel micro-step,
micro_batch_size x dp, as in ``test_moe_training``). 1e-5: only the order of the softmax's, the
cp/dp/ep sums and the norm's squares differs (measured ~1e-7).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import FirstStepHook, Trainer, mesh_for
from tests.harness import run_distributed
from tests.training.common import (
    FAMILIES,
    MOE,
    STRONG_AUX,
    assert_close_rel,
    config,
    trainer_and_data,
)

REL = 1e-5
CPU = torch.device("cpu")
NO_CLIP = ("--clip-grad", "0")
SEQ_AUX = (*STRONG_AUX, "--moe-router-load-balancing-type", "seq_aux_loss")
GLOBAL_AUX = (*STRONG_AUX, "--moe-router-load-balancing-type", "global_aux_loss")
CP2 = ("--context-parallel-size", "2")
EP2 = ("--expert-model-parallel-size", "2")


class _FirstGrads(FirstStepHook):
    """The synced grads of the first step, by global name (experts split by global index)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def after_first_update(self, trainer: Trainer) -> None:
        ep_rank = trainer.ps.rank("ep")
        for chunk in trainer.model:
            for name, p in chunk.module.named_parameters():
                if ".experts.weight" in name:  # [E_local, ...]: local expert i is global r*E_l+i
                    for i, g in enumerate(p.main_grad):
                        self.grads[f"{name}[{ep_rank * len(p.main_grad) + i}]"] = g.clone()
                else:
                    self.grads[name] = p.main_grad.clone()


def _flags(family: str, extra: tuple) -> list[str]:
    return [*FAMILIES[family], *MOE[family], *NO_CLIP, *extra]


def _run(cfg, ps: ParallelState) -> tuple:
    """(is last stage, first-step grads, (losses, grad norms, aux losses, z losses))."""
    trainer, data = trainer_and_data(cfg, ps)
    hook = _FirstGrads()
    trainer.first_step_hooks.append(hook)
    result = trainer.train(make_forward_step(CPU), data)
    aux = [m["load_balancing_loss"] for m in result.moe_losses]
    z = [m["z_loss"] for m in result.moe_losses]
    return ps.is_last_stage, hook.grads, (result.losses, result.grad_norms, aux, z)


@functools.cache
def _oracle(family: str, extra: tuple) -> tuple:
    return _run(config(*_flags(family, extra)), ParallelState.single())[1:]


def _oracle_extra(extra: tuple, layout: tuple) -> tuple:
    """``global_aux_loss`` counts the tokens of the data-parallel micro-step: its oracle's
    micro-batch is micro_batch_size x dp (dp = 4 / cp here)."""
    if "global_aux_loss" not in extra:
        return extra
    return (*extra, "--micro-batch-size", str(2 * 4 // 2))


def _layouts_case(layouts) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for family, extra, layout in layouts:
        cfg = config(*_flags(family, extra), *layout, world_size=world, rank=rank)
        ps = mesh_for(cfg.parallel)
        try:
            out[(family, extra, layout)] = _run(cfg, ps)
        finally:
            ps.destroy()
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


LAYOUTS = [  # (family, model flags, layout) on 4 ranks
    ("gpt2", STRONG_AUX, (*CP2, "--cp-comm-type", "p2p")),  # CP2 x DP2
    ("llama", STRONG_AUX, (*CP2, "--cp-comm-type", "a2a")),
    ("gpt2", STRONG_AUX, (*CP2, *EP2, "--cp-comm-type", "a2a")),  # CP2 x EP2: edp over cp
    ("llama", STRONG_AUX, (*CP2, *EP2, "--cp-comm-type", "p2p")),
    ("gpt2", SEQ_AUX, (*CP2, *EP2)),
    ("gpt2", GLOBAL_AUX, (*CP2, *EP2)),
]


def test_moe_grads_and_aux_losses_under_cp_equal_single_process():
    results = run_distributed(_layouts_case, 4, LAYOUTS, timeout=600)
    for family, extra, layout in LAYOUTS:
        grads, (losses, norms, aux, z) = _oracle(family, _oracle_extra(extra, layout))
        assert max(losses) - min(losses) > 1e-4, "the oracle's losses do not move: vacuous"
        assert len(aux) == 5 and min(aux) > 0 and min(z) > 0
        for rank, r in enumerate(results):
            is_last, got_grads, (got_losses, got_norms, got_aux, got_z) = r[(family, extra, layout)]
            what = f"{family} {' '.join(extra + layout)} rank {rank}"
            errors = {n: _err(g, grads[n]) for n, g in got_grads.items()}
            worst = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
            assert worst[0][1] < REL, f"{what} first-step grads, worst: {worst}"
            assert any("[" in n for n in got_grads), f"{what}: no expert grads"
            assert_close_rel(got_norms, norms, REL, what + " grad norm")
            assert_close_rel(got_aux, aux, REL, what + " load-balancing loss")
            assert_close_rel(got_z, z, REL, what + " z loss")
            if is_last:
                assert_close_rel(got_losses, losses, REL, what + " loss")
        # every expert's grad is checked on some rank
        seen = {n for r in results for n in r[(family, extra, layout)][1]}
        assert seen == set(grads), (family, extra, layout, sorted(set(grads) - seen))
