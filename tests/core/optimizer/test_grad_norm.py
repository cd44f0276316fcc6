"""Global grad-norm clipping across TP x DP equals ``torch.nn.utils.clip_grad_norm_`` on the
single-process model.

4 ranks (TP 2 with sequence parallel x DP 2), both families, one global batch: the grads after DP
and SP sync are clipped by ``grad_norm`` (over the model-parallel group) + ``clip_grads_by_norm``;
the oracle is the same GPTModel with ``ParallelState.single()`` fed the whole global batch,
clipped by torch. The norm and every clipped grad shard (the oracle's grad chunked along the
parameter's partition dim, per stride block, with the vocabulary padding of the TP layout) agree to
1e-5 relative (fp32 sums in a different order). Counting the replicated parameters on both TP ranks
moves the norm by ~25% here, failing the check. The unit tests check the counting rule, the
inf-norm and non-finite detection in one process against float64 sums and torch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite.core.optimizer import clip_grads_by_norm, grad_norm, param_is_counted
from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.forward_backward import forward_backward_no_pipelining
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, config, trainer_and_data

CPU = torch.device("cpu")
CLIP = 0.3  # well below the ~1.0 norm of the first step: clipping is active


def _grads_after_sync(cfg, ps) -> tuple[object, list]:
    trainer, data = trainer_and_data(cfg, ps)
    (chunk,) = trainer.model
    model = chunk.grad_wrapper
    model.zero_grad_buffer()
    forward_backward_no_pipelining(
        forward_step_func=make_forward_step(CPU),
        data_iterator=data,
        model=[chunk],
        num_microbatches=trainer.num_microbatches,
    )
    model.finish_grad_sync()
    return trainer, list(model.module.named_parameters())


def _clip_case(family: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    if rank == 0:  # the oracle: whole model, whole global batch, torch's clip
        trainer, named = _grads_after_sync(config(*FAMILIES[family]), ParallelState.single())
        for _, p in named:
            p.grad = p.main_grad
        total = torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        out["oracle"] = (float(total), {n: p.grad.clone() for n, p in named})
    extra = [*FAMILIES[family], "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    ps = mesh(2, 1)
    try:
        trainer, named = _grads_after_sync(config(*extra, world_size=world, rank=rank), ps)
        grads = [p.main_grad for _, p in named]
        params = [p for _, p in named]
        counted = [g for p, g in zip(params, grads) if param_is_counted(p, tp_rank=ps.tp_rank)]
        total = grad_norm(counted, groups=(ps.mp_group,))
        clip_grads_by_norm(grads, total, CLIP)
        out["mine"] = (
            float(total),
            {
                n: (p.main_grad.clone(), p.partition_dim, getattr(p, "partition_stride", 1))
                for n, p in named
            },
            ps.tp_rank,
        )
    finally:
        ps.destroy()
    return out


def _expected_shard(full: torch.Tensor, like: torch.Tensor, dim, stride: int, tp_rank: int):
    if dim is None:
        return full
    if full.shape[dim] * 1 != like.shape[dim] * 2:  # vocabulary padded further under TP 2
        pad = list(full.shape)
        pad[dim] = like.shape[dim] * 2 - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(2, dim=dim)[tp_rank] for b in blocks], dim=dim)


def test_clip_equals_torch_clip_grad_norm_on_the_single_process_model():
    for family in FAMILIES:
        results = run_distributed(_clip_case, 4, family, timeout=600)
        oracle_norm, oracle = results[0]["oracle"]
        assert oracle_norm > 2 * CLIP  # clipping really scaled the grads
        for rank, r in enumerate(results):
            norm, grads, tp_rank = r["mine"]
            assert math.isclose(norm, oracle_norm, rel_tol=1e-5), (family, rank, norm, oracle_norm)
            for name, (grad, dim, stride) in grads.items():
                want = _expected_shard(oracle[name], grad, dim, stride, tp_rank)
                scale = want.abs().max().item() + 1e-12
                err = (grad - want).abs().max().item()
                assert err <= 1e-5 * scale + 1e-9, (family, rank, name, err, scale)


def _param(shape, *, tp: bool | None = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape))
    if tp is not None:
        p.tensor_model_parallel = tp
    return p


def test_counting_rule_each_parameter_once():
    sharded, replicated, plain, dup = _param(4, tp=True), _param(4, tp=False), _param(4), _param(4)
    dup.tensor_model_parallel = True
    for p in (sharded, replicated, plain):
        assert param_is_counted(p, tp_rank=0, duplicates=[dup])
    assert param_is_counted(sharded, tp_rank=1)
    assert not param_is_counted(replicated, tp_rank=1)
    assert not param_is_counted(plain, tp_rank=1)
    assert not param_is_counted(dup, tp_rank=0, duplicates=[dup])


def test_norms_against_float64_and_torch_in_one_process():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    want = math.sqrt(sum(float(x.double().square().sum()) for x in grads))
    assert math.isclose(float(grad_norm(grads)), want, rel_tol=1e-6)
    want_inf = max(float(x.abs().max()) for x in grads)
    params = [_param(x.shape) for x in grads]
    ref = [x.clone() for x in grads]
    for p, r in zip(params, ref):
        p.grad = r
    torch_total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=math.inf)
    total = grad_norm(grads, norm_type=math.inf)
    clip_grads_by_norm(grads, total, 0.5)
    assert float(total) == want_inf == float(torch_total)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    # a non-finite grad gives a non-finite norm (what the fp16 / NaN checks key on)
    bad = [torch.ones(3), torch.tensor([1.0, math.nan])]
    assert not math.isfinite(float(grad_norm(bad)))
    bad = [torch.ones(3), torch.tensor([1.0, math.inf])]
    assert not math.isfinite(float(grad_norm(bad)))
