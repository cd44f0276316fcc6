"""ZeRO-2 (``Zero2DataParallel``) and ZeRO-3 (``Zero3DataParallel``) against single-process
references, on ``zero_cases.Tiny`` (337 parameters; ZeRO-2 in 40-element buckets, ZeRO-3 in one
bucket per child module: emb, fc1, norm, fc2), DP 2 and 4, all cases of a world in one spawn.

- fp32, clipping active: 5 steps = ``clip_grad_norm_`` + ``torch.optim.AdamW`` on the whole batch
  (params and norms 1e-6 relative), with 1 and with 2 micro-batches per rank (gradient
  accumulation: each bucket reduce-scattered per micro-batch and summed in the shard).
- bf16 params, fp32 grads and masters: masters 1e-6 of the bf16 reference, bf16 params equal.
- fp16, dynamic scaler, an inf in one rank's grad shard at step 2: every rank skips step 2 like
  the plain optimizer (masters 1e-6 after 5 steps).
- an unused parameter (the LayerNorm on odd steps): its bucket stays staged and is reduced at the
  end, = the plain optimizer.
- memory: the grad storage is the shard (numel/d per buffer); the staging peak is at most the
  buckets in flight; ZeRO-3's param bytes are the shard, its peak during forward at most the two
  largest units (the one computed, the one prefetched), and nothing whole is left after the step.
- checkpoint: ZeRO-3's sharded state save -> load continues bitwise; its full state resumes under
  ZeRO-1 at another bucket layout and ZeRO-1's under ZeRO-3 (1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.distributed import wrapper_class
from megalite.core.optimizer import DynamicLossScaler, build_sharded_optimizer
from tests.core import zero_cases as zc
from tests.core.optimizer.test_sharded_optimizer import bf16_reference, plain_run
from tests.harness import run_distributed

REL = 1e-6
RUNGS = ("optim_grads", "optim_grads_params")


def setup(rung, dtype=torch.float32, *, fp16_scale=None, clip=zc.CLIP, bucket=zc.BUCKET):
    group = dist.group.WORLD if dist.is_initialized() else None
    model = wrapper_class(rung)(
        zc.tiny(dtype), dp_group=group, accumulate_allreduce_grads_in_fp32=True, bucket_size=bucket
    )
    scaler = None if fp16_scale is None else DynamicLossScaler(fp16_scale, hysteresis=1)
    opt = build_sharded_optimizer(
        model, lr=zc.LR, weight_decay=zc.WD, clip_grad=clip, loss_scaler=scaler
    )
    return model, opt


def run(model, opt, steps, *, micro=1, inject=None, before=None) -> list:
    rank, dp = zc.dp_info()
    out = []
    for step in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        if before is not None:
            before(model, step)
        batches = zc.micro_batches(step, dp * micro)[rank * micro : (rank + 1) * micro]
        zc.backward_micro_batches(model, opt, batches)
        if inject is not None:
            inject(model, step)
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        out.append((ok, None if norm is None else float(norm)))
    return out


def params(model) -> list[torch.Tensor]:
    with model.gathered_params():
        return [p.detach().clone() for p in model.module.parameters()]


def masters(opt) -> list[torch.Tensor]:
    full = opt.full_state_dict()["params"]
    return [full[n]["master"] for n, _ in zc.tiny().named_parameters()]


def inject_inf(model, step):
    rank, dp = zc.dp_info()
    if step == 2 and rank == dp - 1:
        model.grad_buffers[0].data[0] = float("inf")


def memory(model, opt) -> dict:
    _, dp = zc.dp_info()
    out = {
        "grad_numel": [b.data.numel() for b in model.grad_buffers],
        "buffer_numel": [b.layout.numel for b in model.grad_buffers],
        "bucket_numels": [[b.numel for b in buf.layout.buckets] for buf in model.grad_buffers],
        "staged_peak": model.staged_peak_bytes,
        "staged_after": model.staged_bytes(),
    }
    if model.zero_stage == 3:  # whole units gathered per use
        model.reset_peak()
        out["gathered_before"] = model.gathered_bytes()
        tokens, targets = zc.micro_batches(0, dp)[zc.dp_info()[0]]
        with torch.no_grad():
            zc.loss_of(model, tokens, targets)
        out["param_peak_forward"] = model.param_peak_bytes
        out["shard_bytes"] = sum(s.numel() * s.element_size() for s in model.param_shards.values())
    return out


def ladder_cases() -> dict:
    out = {}
    for rung in RUNGS:
        r = out[rung] = {}
        for micro in (1, 2):
            model, opt = setup(rung)
            r[f"fp32_micro{micro}"] = (run(model, opt, range(5), micro=micro), params(model))
        r["memory"] = memory(model, opt)
        model, opt = setup(rung, torch.bfloat16, clip=0.0)
        run(model, opt, range(5))
        r["bf16"] = (masters(opt), params(model))
        model, opt = setup(rung, torch.float16, fp16_scale=1024.0)
        r["fp16"] = (run(model, opt, range(5), inject=inject_inf), masters(opt))
        model, opt = setup(rung)
        run(model, opt, range(4), before=zc.skip_norm_on_odd_steps)
        r["unused"] = params(model)
    out["ckpt"] = checkpoint_case()
    return out


def checkpoint_case() -> dict:
    dtype, z3 = torch.bfloat16, "optim_grads_params"
    model, opt = setup(z3, dtype)
    run(model, opt, range(5))
    uninterrupted = params(model)
    model, opt = setup(z3, dtype)
    run(model, opt, range(3))
    shard, full, weights = opt.sharded_state_dict(), opt.full_state_dict(), model.state_dict()
    model2, opt2 = setup(z3, dtype)  # ZeRO-3 -> ZeRO-3, sharded state
    model2.load_state_dict(weights)
    opt2.load_sharded_state_dict(shard)
    run(model2, opt2, range(3, 5))
    model3, opt3 = setup("optim", dtype, bucket=100)  # ZeRO-3 -> ZeRO-1, another layout
    opt3.load_full_state_dict(full)
    run(model3, opt3, range(3, 5))
    model4, opt4 = setup("optim", dtype, bucket=100)  # ZeRO-1 -> ZeRO-3
    run(model4, opt4, range(3))
    model5, opt5 = setup(z3, dtype)
    opt5.load_full_state_dict(opt4.full_state_dict())
    run(model5, opt5, range(3, 5))
    run(model4, opt4, range(3, 5))
    return {
        "uninterrupted": uninterrupted,
        "sharded": params(model2),
        "to_zero1": params(model3),
        "zero1": params(model4),
        "from_zero1": params(model5),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda dp: f"dp{dp}")
def results(request):
    return request.param, run_distributed(ladder_cases, request.param, timeout=180)


def test_fp32_five_steps_equal_torch_adamw_with_clipping_and_accumulation(results):
    dp, per_rank = results
    ref_params, ref_norms = zc.torch_reference(5)
    for rank, out in enumerate(per_rank):
        for rung in RUNGS:
            for micro in (1, 2):
                steps, got = out[rung][f"fp32_micro{micro}"]
                for (ok, norm), ref in zip(steps, ref_norms):
                    assert ok and abs(norm - ref) <= REL * ref, (dp, rank, rung, micro, norm)
                for g, r in zip(got, ref_params):
                    assert zc.rel_err(g, r) <= REL, (dp, rank, rung, micro, zc.rel_err(g, r))


def test_bf16_fp16_and_unused_params_equal_the_plain_references(results):
    dp, per_rank = results
    ref_masters, ref_params = bf16_reference(dp, 5)
    _, plain16, ref16 = plain_run(torch.float16, range(5), dp=dp, fp16_scale=1024.0)
    del ref16
    _, plain_unused, _ = plain_run(torch.float32, range(4), dp=dp, before=zc.skip_norm_on_odd_steps)
    unused_ref = [p.detach() for p in plain_unused.model_params]
    names = [n for n, _ in zc.tiny().named_parameters()]
    order = [plain_unused.param_names.index(n) for n in names]
    for rank, out in enumerate(per_rank):
        for rung in RUNGS:
            got_masters, got_params = out[rung]["bf16"]
            for g, r in zip(got_masters, ref_masters):
                assert zc.rel_err(g, r) <= REL, (dp, rung, zc.rel_err(g, r))
            for g, r in zip(got_params, ref_params):
                assert g.dtype == torch.bfloat16 and torch.equal(g, r), (dp, rank, rung)
            steps, _ = out[rung]["fp16"]
            assert [ok for ok, _ in steps] == [True, True, False, True, True], (dp, rung, steps)
            for g, i in zip(out[rung]["unused"], order):
                assert zc.rel_err(g, unused_ref[i]) <= REL, (dp, rung, names[i])


def test_grad_and_param_bytes_are_sharded(results):
    dp, per_rank = results
    for out in per_rank:
        for rung in RUNGS:
            m = out[rung]["memory"]
            assert [n * dp for n in m["grad_numel"]] == m["buffer_numel"]
            largest = max(n for buf in m["bucket_numels"] for n in buf) * 4
            assert m["staged_after"] == 0
            assert 0 < m["staged_peak"] <= 2 * largest, (rung, m)
        m = out["optim_grads_params"]["memory"]
        units = sorted(n * 4 for buf in m["bucket_numels"] for n in buf)
        assert m["gathered_before"] == 0
        assert m["shard_bytes"] * dp == sum(units)
        assert max(units) <= m["param_peak_forward"] <= units[-1] + units[-2], m


def test_zero3_checkpoints_resume_under_zero3_and_zero1_and_back(results):
    dp, per_rank = results
    for out in per_rank:
        c = out["ckpt"]
        assert all(torch.equal(a, b) for a, b in zip(c["sharded"], c["uninterrupted"]))
        for a, b in zip(c["to_zero1"], c["uninterrupted"]):
            assert zc.rel_err(a.float(), b.float()) <= 1e-2 and a.dtype == b.dtype
        assert all(torch.equal(a, b) for a, b in zip(c["to_zero1"], c["uninterrupted"]))
        assert all(torch.equal(a, b) for a, b in zip(c["from_zero1"], c["zero1"]))
