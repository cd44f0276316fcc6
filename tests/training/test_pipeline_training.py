"""Pipeline parallelism in the real training loop: 5 steps equal the single-process run.

The full 3D layout TP2 x PP2 x DP2 (8 processes) with sequence parallel, for both families (GPT-2's
tied embedding then lives on both the first and the last stage); PP2 x DP2 with GPipe and with an
uneven split (``--decoder-first-pipeline-num-layers``), and in Megatron's alternative rank order
(``--use-tp-pp-dp-mapping``: a pipeline is consecutive ranks); PP4. The 5 losses and grad norms
(clipping is computed across TP, PP and DP) equal the oracle: the same GPTModel with
``ParallelState.single()`` fed every micro-batch of each global batch. 1e-5 relative, as in
test_equivalence (fp32, only the order of sums differs). The losses are logged on the last stage
only.
"""

from __future__ import annotations

import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-5


def _run(layouts: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> dict:
    """layouts: (family, model flags, layout flags); the oracle gets the first two only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (family, model_flags, layout_flags) in enumerate(layouts):
        extra = [*FAMILIES[family], *model_flags]
        oracle = None
        if i % world == rank:  # spread the oracles over the ranks
            result = train_losses(config(*extra), ParallelState.single())
            oracle = (result.losses, result.grad_norms)
        cfg = config(*extra, *layout_flags, world_size=world, rank=rank)
        par = cfg.parallel
        ps = mesh(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size, order=par.rank_order
        )
        if par.use_tp_pp_dp_mapping:  # tp-pp-dp: with TP 1 a pipeline is consecutive ranks
            first = ps.pp_ranks[0]
            assert ps.pp_ranks == list(range(first, first + ps.pp_size)), ps.pp_ranks
        try:
            result = train_losses(cfg, ps)
        finally:
            ps.destroy()
        out[i] = (ps.pp_rank, ps.is_last_stage, result.losses, result.grad_norms, oracle)
    return out


def _check(layouts, results) -> None:
    for i, (family, model_flags, flags) in enumerate(layouts):
        (oracle,) = [r[i][4] for r in results if r[i][4] is not None]
        assert oracle[0][-1] < oracle[0][0], "the oracle does not train: the check is vacuous"
        for rank, r in enumerate(results):
            pp_rank, is_last, losses, norms, _ = r[i]
            what = f"{family} {' '.join(model_flags + flags)} rank {rank}"
            assert_close_rel(norms, oracle[1], REL, what + " grad norm")
            if is_last:
                assert_close_rel(losses, oracle[0], REL, what + " loss")
            else:
                assert losses == [], what + ": a non-last stage reported losses"


def test_3d_tp2_pp2_dp2_sequence_parallel_equals_single_process():
    tp2pp2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    layouts = [
        ("gpt2", (), (*tp2pp2, "--sequence-parallel")),
        ("llama", (), (*tp2pp2, "--sequence-parallel")),
    ]
    _check(layouts, run_distributed(_run, 8, layouts, timeout=600))


def test_pp2_dp2_gpipe_and_uneven_and_pp4_equal_single_process():
    pp2 = ("--pipeline-model-parallel-size", "2")
    layouts = [
        ("gpt2", (), (*pp2, "--pipeline-schedule", "gpipe")),
        ("gpt2", ("--num-layers", "3"), (*pp2, "--decoder-first-pipeline-num-layers", "1")),
        ("llama", (), (*pp2, "--use-tp-pp-dp-mapping")),
        ("llama", ("--num-layers", "4"), ("--pipeline-model-parallel-size", "4")),
    ]
    _check(layouts, run_distributed(_run, 4, layouts, timeout=600))
