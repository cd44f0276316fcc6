"""ZeRO-1 (Zero1DataParallel + ShardedOptimizer) against plainly written references.

The model (``zero_cases.Tiny``, 7 tensors, 337 parameters, 3 buckets) is cut by shard boundaries
inside parameters at DP 2 and 4. DP rank ``r`` trains on chunk ``r`` of each global
batch; the references see the whole batch in one process. All cases of one world size run in one
``run_distributed`` call (DP 1: in this process).

- fp32, clipping active at 0.5 (every step's norm is ~1.5): 5 steps equal ``clip_grad_norm_`` +
  ``torch.optim.AdamW`` with the same weight-decay groups on the whole batch: params and grad norms
  within 1e-6 relative (the DP mean and the norm are summed in another order: ~1e-7 per step).
- overlap (grad reduce-scatter started from the grad hooks, param all-gather waited for by forward
  pre-hooks), 2 micro-batches per rank: bitwise equal to the run without overlap (same sums in the
  same order), and the overlap really happened (reductions in flight before ``finish_grad_sync``,
  gathers in flight after ``step``).
- bf16 params with fp32 grads and masters, no clipping: equal to a plain bf16 reference that keeps
  fp32 master copies (per-rank micro-batch grads summed in fp32, ``torch.optim.AdamW`` on the
  masters, masters rounded into the bf16 model): masters within 1e-6 relative (exact at DP 2,
  where the two-term sums are the same), bf16 params equal; and the masters hold what bf16 cannot.
- fp16 with a dynamic loss scaler (hysteresis 1) and an inf put into one rank's grad at step 2, in
  an element another rank owns: every rank skips that step and halves the scale, like
  ``UnshardedOptimizer`` in one process with the same inf; the other steps and the clipped
  norms agree (masters 1e-6).
- a parameter without a grad in a step (the LayerNorm, unused on odd steps) is updated with a zero
  grad, as by the plain optimizer, although ZeRO-1 does not clear the buffer between steps.
- checkpoints: sharded save -> load -> 2 more steps is bitwise the uninterrupted run; the full
  state loaded into another bucket layout, into the plain optimizer in one process, and from the
  plain optimizer into ZeRO-1, continue to the same params (1e-6); ``full_state_from_shards`` of
  the DP files equals ``full_state_dict`` exactly; a shard of another DP rank is refused.
- memory: optimizer-state bytes per rank (fp32 masters + exp_avg + exp_avg_sq, distinct storages)
  are 12 bytes x the padded shard + 4 per step counter, within 12 x padding of 12P/DP, and 1/DP of
  the plain optimizer's 12P.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from megalite.core.distributed import Zero1DataParallel
from megalite.core.optimizer import (
    build_sharded_optimizer,
    full_state_from_shards,
    get_param_groups,
)
from megalite.core.optimizer.memory_report import model_state_bytes
from tests.core import zero_cases as zc
from tests.harness import run_distributed

REL = 1e-6


# --- the cases (run on every rank) ---------------------------------------------------------------


def _run(model, opt, steps: range, *, micro: int = 1, inject=None, before=None) -> list:
    """Train ``steps``; this rank's share of each global batch as ``micro`` micro-batches.
    Returns per step (update_successful, grad norm, reductions in flight before
    ``finish_grad_sync``, gathers in flight after ``step``)."""
    rank, dp = zc.dp_info()
    return [
        _step(model, opt, step, rank=rank, dp=dp, micro=micro, inject=inject, before=before)
        for step in steps
    ]


def _step(model, opt, step, *, rank, dp, micro, inject, before=None):
    model.zero_grad_buffer()
    opt.zero_grad()
    if before is not None:
        before(model, step)
    batches = zc.micro_batches(step, dp * micro)[rank * micro : (rank + 1) * micro]
    zc.backward_micro_batches(model, opt, batches)
    in_flight = len(model._reducing)
    if inject is not None:
        inject(model, step)
    model.finish_grad_sync()
    ok, norm, _ = opt.step()
    return ok, None if norm is None else float(norm), in_flight, len(model._gathering)


def _masters(opt) -> list[torch.Tensor]:
    full = opt.full_state_dict()["params"]
    return [full[name]["master"] for name in _names()]


def _names() -> list[str]:
    return [n for n, _ in zc.tiny().named_parameters()]


def _fp16_inject(model, step):
    """Step 2, last rank: inf at the first element of the first bucket (owned by DP rank 0)."""
    rank, dp = zc.dp_info()
    if step == 2 and rank == dp - 1:
        model.grad_buffers[0].data[0] = float("inf")


def _memory(model, opt) -> dict:
    s = model_state_bytes(model, opt, dp_size=zc.dp_info()[1])
    shard = sum(sb.numel for sb in opt.buffers)
    return {"bytes": s, "shard": shard, "pieces": len(opt.pieces)}


def dp_cases() -> dict:
    rank, dp = zc.dp_info()
    out = {}
    model, opt = zc.zero_setup()
    out["fp32"] = (_run(model, opt, range(5)), zc.params_of(model))

    runs = {}
    for overlap in (False, True):
        model, opt = _overlap_setup(overlap)
        runs[overlap] = (_run(model, opt, range(5), micro=2), zc.params_of(model))
    out["overlap"] = runs

    model, opt = zc.zero_setup(torch.bfloat16, clip=0.0)
    _run(model, opt, range(5))
    out["bf16"] = (_masters(opt), zc.params_of(model), _memory(model, opt))

    model, opt = zc.zero_setup(torch.float16, fp16_scale=1024.0)
    steps = _run(model, opt, range(5), inject=_fp16_inject)
    out["fp16"] = (steps, _masters(opt), float(opt.get_loss_scale()))

    model, opt = zc.zero_setup()
    _run(model, opt, range(4), before=zc.skip_norm_on_odd_steps)
    out["unused"] = zc.params_of(model)

    out["ckpt"] = _checkpoint_case()
    return out


def _overlap_setup(overlap: bool):
    """fp32, built as components does, overlap on or off."""
    group = dist.group.WORLD if dist.is_initialized() else None
    model = Zero1DataParallel(
        zc.tiny(),
        dp_group=group,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=zc.BUCKET,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    opt = build_sharded_optimizer(model, lr=zc.LR, weight_decay=zc.WD, clip_grad=zc.CLIP)
    return model, opt


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _checkpoint_case() -> dict:
    rank, dp = zc.dp_info()
    dtype = torch.bfloat16
    model, opt = zc.zero_setup(dtype)
    _run(model, opt, range(5))
    uninterrupted = zc.params_of(model)

    model, opt = zc.zero_setup(dtype)
    _run(model, opt, range(3))
    saved = _save_load(
        {
            "model": model.state_dict(),
            "shard": opt.sharded_state_dict(),
            "full": opt.full_state_dict(),
        }
    )
    shards = [None] * dp
    if dp > 1:
        dist.all_gather_object(shards, saved["shard"])
    else:
        shards = [saved["shard"]]
    offline_equal = all(
        torch.equal(v, saved["full"]["params"][n][k])
        for n, entry in full_state_from_shards(shards)["params"].items()
        for k, v in entry.items()
    )
    # sharded: same layout, fresh objects
    model2, opt2 = zc.zero_setup(dtype)
    model2.load_state_dict(saved["model"])
    opt2.load_sharded_state_dict(saved["shard"])
    _run(model2, opt2, range(3, 5))
    # full: another bucket layout
    model3, opt3 = zc.zero_setup(dtype, bucket=100)
    opt3.load_full_state_dict(saved["full"])
    _run(model3, opt3, range(3, 5))
    wrong_rank = None
    if dp > 1:
        try:
            opt3.load_sharded_state_dict(shards[(rank + 1) % dp])
        except ValueError as e:
            wrong_rank = str(e)
    return {
        "uninterrupted": uninterrupted,
        "sharded": zc.params_of(model2),
        "relayout": zc.params_of(model3),
        "full": saved["full"] if rank == 0 else None,
        "offline_equal": offline_equal,
        "wrong_rank": wrong_rank,
    }


def plain_into_zero_case(full: dict) -> list[torch.Tensor]:
    """ZeRO-1 loads the plain optimizer's full state of step 3 and runs steps 3, 4."""
    model, opt = zc.zero_setup(torch.bfloat16)
    opt.load_full_state_dict(full)
    _run(model, opt, range(3, 5))
    return zc.params_of(model)


# --- single-process references -------------------------------------------------------------------


def bf16_reference(dp: int, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """bf16 model + fp32 master copies + torch AdamW on the masters; each rank's chunk is a
    micro-batch whose bf16 grads are summed in fp32 in rank order, then divided by ``dp``."""
    model = zc.tiny(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        {**g, "params": [masters[index[id(p)]] for p in g["params"]]}
        for g in get_param_groups(model, weight_decay=zc.WD)
    ]
    opt = torch.optim.AdamW(groups, lr=zc.LR, weight_decay=zc.WD)
    for step in range(steps):
        sums = [torch.zeros_like(m) for m in masters]
        for tokens, targets in zc.micro_batches(step, dp):
            grads = torch.autograd.grad(zc.loss_of(model, tokens, targets), params)
            for s, g in zip(sums, grads):
                s.add_(g.float())
        for m, s in zip(masters, sums):
            m.grad = s / dp
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return [m.detach() for m in masters], [p.detach().clone() for p in params]


def plain_run(
    dtype, steps: range, *, dp: int, fp16_scale=None, full=None, inject=None, before=None
):
    """The non-distributed UnshardedOptimizer, every rank's chunk as a micro-batch."""
    model, opt = zc.plain_setup(dtype, fp16_scale=fp16_scale)
    if full is not None:
        opt.load_full_state_dict(full)
    out = []
    for step in steps:
        out.append(zc.train_step(model, opt, step, parts=dp, inject=inject, before=before))
    return model, opt, out


# --- the checks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda dp: f"dp{dp}")
def dp_results(request):
    dp = request.param
    if dp == 1:
        return dp, [dp_cases()]
    return dp, run_distributed(dp_cases, dp, timeout=600)


def test_fp32_five_steps_equal_torch_adamw_with_clipping(dp_results):
    dp, results = dp_results
    ref_params, ref_norms = zc.torch_reference(5)
    assert min(ref_norms) > zc.CLIP, "clipping must be active in every step"
    for rank, r in enumerate(results):
        steps, params = r["fp32"]
        for step, ((ok, norm, _, _), ref) in enumerate(zip(steps, ref_norms)):
            assert ok and abs(norm - ref) <= REL * ref, (dp, rank, step, norm, ref)
        for name, got, ref in zip(_names(), params, ref_params):
            assert zc.rel_err(got, ref) <= REL, (dp, rank, name, zc.rel_err(got, ref))
    # the update is not vacuous: params moved by far more than the tolerance
    start = [p.detach() for p in zc.tiny().parameters()]
    assert max(zc.rel_err(p, s) for p, s in zip(ref_params, start)) > 1e-3


def test_overlapped_reduce_and_gather_are_bitwise_the_same_and_really_overlap(dp_results):
    dp, results = dp_results
    ref_params, _ = zc.torch_reference(5)
    for r in results:
        (plain_steps, plain_params), (ovl_steps, ovl_params) = (
            r["overlap"][False],
            r["overlap"][True],
        )
        assert all(torch.equal(a, b) for a, b in zip(plain_params, ovl_params))
        assert [s[1] for s in plain_steps] == [s[1] for s in ovl_steps]
        for got, ref in zip(ovl_params, ref_params):
            assert zc.rel_err(got, ref) <= REL
        if dp > 1:  # reductions started in backward; gathers left in flight by step()
            assert all(s[2] > 0 for s in ovl_steps) and all(s[3] > 0 for s in ovl_steps)
            assert all(s[2] == 0 and s[3] == 0 for s in plain_steps)


def test_bf16_with_fp32_master_equals_plain_bf16_reference(dp_results):
    dp, results = dp_results
    ref_masters, ref_params = bf16_reference(dp, 5)
    for rank, r in enumerate(results):
        masters, params, _ = r["bf16"]
        for name, got, ref in zip(_names(), masters, ref_masters):
            assert zc.rel_err(got, ref) <= REL, (dp, rank, name, zc.rel_err(got, ref))
        for name, got, ref in zip(_names(), params, ref_params):
            assert got.dtype == torch.bfloat16 and torch.equal(got, ref), (dp, rank, name)
        assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)


def test_fp16_overflow_skips_the_same_step_as_the_plain_optimizer(dp_results):
    dp, results = dp_results

    def inject(model, step):  # the same element: first element of the first bucket
        if step == 2:
            model.grad_buffers[0].data[0] = float("inf")

    _, plain, ref_steps = plain_run(
        torch.float16, range(5), dp=dp, fp16_scale=1024.0, inject=inject
    )
    ref_masters = [m.detach() for m in plain.master_params]
    ref_masters = [ref_masters[i] for i in _plain_to_model_order(plain)]
    for rank, r in enumerate(results):
        steps, masters, scale = r["fp16"]
        assert [s[0] for s in steps] == [True, True, False, True, True], (dp, rank)
        assert [s[0] for s in ref_steps] == [True, True, False, True, True]
        assert scale == float(plain.get_loss_scale()) == 512.0
        for (_, norm, _, _), (_, ref) in zip(steps, ref_steps):
            assert (norm is None) == (ref is None) and (
                norm is None or abs(norm - ref) <= REL * ref
            )
        for got, ref in zip(masters, ref_masters):
            assert zc.rel_err(got, ref) <= REL


def _plain_to_model_order(plain) -> list[int]:
    """Indices into ``plain.master_params`` (param-group order) in named_parameters order."""
    return [plain.param_names.index(n) for n in _names()]


def test_unused_parameter_gets_a_zero_grad_like_the_plain_optimizer(dp_results):
    """The buffer is not cleared between steps: a parameter without a grad must still see 0."""
    dp, results = dp_results
    model, _, _ = plain_run(torch.float32, range(4), dp=dp, before=zc.skip_norm_on_odd_steps)
    ref = zc.params_of(model)
    for r in results:
        for name, got, want in zip(_names(), r["unused"], ref):
            assert zc.rel_err(got, want) <= REL, (dp, name, zc.rel_err(got, want))


def test_checkpoint_round_trips_continue_like_the_uninterrupted_run(dp_results):
    dp, results = dp_results
    for rank, r in enumerate(results):
        c = r["ckpt"]
        assert all(torch.equal(a, b) for a, b in zip(c["sharded"], c["uninterrupted"])), rank
        for got, ref in zip(c["relayout"], c["uninterrupted"]):
            assert zc.rel_err(got, ref) <= REL
        assert c["offline_equal"]
        if dp > 1:
            assert "DP rank" in c["wrong_rank"] and "full state" in c["wrong_rank"]
    full = results[0]["ckpt"]["full"]
    uninterrupted = results[0]["ckpt"]["uninterrupted"]
    assert sorted(full["params"]) == sorted(_names()) and full["step"] == 3
    # ZeRO-1 -> plain optimizer in one process, DP 1
    model, _, _ = plain_run(torch.bfloat16, range(3, 5), dp=dp, full=full)
    for got, ref in zip(zc.params_of(model), uninterrupted):
        assert zc.rel_err(got, ref) <= REL
    # plain optimizer -> ZeRO-1
    _, plain, _ = plain_run(torch.bfloat16, range(3), dp=dp)
    plain_full = plain.full_state_dict()
    if dp == 1:
        back = [plain_into_zero_case(plain_full)]
    else:
        back = run_distributed(plain_into_zero_case, dp, plain_full, timeout=600)
    for params in back:
        for got, ref in zip(params, uninterrupted):
            assert zc.rel_err(got, ref) <= REL


def test_optimizer_state_bytes_are_12_phi_over_dp_within_padding(dp_results):
    dp, results = dp_results
    phi = sum(p.numel() for p in zc.tiny().parameters())
    plain_model, plain, _ = plain_run(torch.bfloat16, range(1), dp=1)
    plain_bytes = model_state_bytes(plain_model, plain, dp_size=1)
    assert plain_bytes.master + plain_bytes.optimizer == 12 * phi + 4 * 7  # 7 step counters
    for r in results:
        m = r["bf16"][2]
        s, shard = m["bytes"], m["shard"]
        assert s.master + s.optimizer == 12 * shard + 4 * m["pieces"]
        padding = 3 * (dp - 1)  # < dp elements per bucket, 3 buckets
        assert abs(12 * shard - 12 * phi / dp) <= 12 * padding
        assert s.params == 2 * dp * shard and s.grads == 4 * dp * shard  # whole padded buffers
        assert abs(s.theory - (2 * phi + 4 * phi + 12 * phi / dp)) <= 1
        ratio = (s.master + s.optimizer) / (plain_bytes.master + plain_bytes.optimizer)
        assert 0.95 / dp <= ratio <= 1.1 / dp, ratio  # padding + step counters on 337 params
