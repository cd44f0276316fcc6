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
  buckets in flight; ZeRO-3's param bytes are the shard; in a training step (forward, backward,
  sync, update) the whole-unit bytes, counted from the parameters' storages at every op
  (``ParamStorageBytes``), peak at exactly the largest pair of neighbouring units (the one
  computed, the one prefetched) in forward and in backward, and nothing whole is left after.
- checkpoint: ZeRO-3's sharded state save -> load continues bitwise; its full state resumes under
  ZeRO-1 at another bucket layout and ZeRO-1's under ZeRO-3 (1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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


class ParamStorageBytes(TorchDispatchMode):
    """Bytes of the distinct storages behind ``params`` that are materialised (ZeRO-3 resizes a
    released unit's storage to 0 bytes), sampled before and after every op that reaches the
    dispatcher, forward and backward (the copy into a freshly gathered unit is one): counted from
    the storages themselves, not from the wrapper's bookkeeping. ``peak[phase]``: the most seen
    while ``phase`` was set."""

    def __init__(self, params) -> None:
        super().__init__()
        self.params, self.phase = list(params), "idle"
        self.peak: dict[str, int] = {}
        self.ops: dict[str, int] = {}

    def now(self) -> int:
        storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in self.params}
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sample()
        out = func(*args, **(kwargs or {}))
        self._sample()
        self.ops[self.phase] = self.ops.get(self.phase, 0) + 1
        return out

    def _sample(self) -> None:
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.now())


def memory(model, opt) -> dict:
    _, dp = zc.dp_info()
    out = {
        "grad_numel": [b.data.numel() for b in model.grad_buffers],
        "buffer_numel": [b.layout.numel for b in model.grad_buffers],
        "bucket_numels": [[b.numel for b in buf.layout.buckets] for buf in model.grad_buffers],
        "staged_peak": model.staged_peak_bytes,
        "staged_after": model.staged_bytes(),
    }
    if model.zero_stage == 3:  # whole units gathered per use, in a training step
        rank = zc.dp_info()[0]
        counter = ParamStorageBytes(model.module.parameters())
        out["unit_numels"] = [sum(p.numel() for p in u.parameters()) for u in model.units]
        out["whole_before"] = counter.now()
        model.zero_grad_buffer()
        opt.zero_grad()
        tokens, targets = zc.micro_batches(5, dp)[rank]
        with counter:
            counter.phase = "forward"
            loss = opt.scale_loss(zc.loss_of(model, tokens, targets))
            counter.phase = "backward"
            loss.backward()
            counter.phase = "step"
            model.finish_grad_sync()
            ok, _, _ = opt.step()
        out["step_ok"] = ok
        out["param_peak"] = counter.peak
        out["ops"] = counter.ops
        out["whole_after"] = counter.now()
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
        steps = run(model, opt, range(5), inject=inject_inf)
        r["fp16"] = (steps, masters(opt), float(opt.get_loss_scale()))
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
    return request.param, run_distributed(ladder_cases, request.param, timeout=600)


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


def test_bf16_and_unused_params_equal_the_plain_references(results):
    dp, per_rank = results
    ref_masters, ref_params = bf16_reference(dp, 5)
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
            for g, i in zip(out[rung]["unused"], order):
                assert zc.rel_err(g, unused_ref[i]) <= REL, (dp, rung, names[i])


def test_fp16_overflow_skips_the_same_step_as_the_plain_optimizer(results):
    """An inf in one rank's grad shard at step 2: every rank skips that step and halves the scale,
    as the plain optimizer in one process with an inf in its grad at step 2; the other steps'
    clipped norms and the masters after 5 steps agree (1e-6)."""
    dp, per_rank = results

    def inject(model, step):  # where the inf lands does not matter: the step is skipped whole
        if step == 2:
            model.grad_buffers[0].data[0] = float("inf")

    _, plain, ref_steps = plain_run(
        torch.float16, range(5), dp=dp, fp16_scale=1024.0, inject=inject
    )
    assert [ok for ok, _ in ref_steps] == [True, True, False, True, True], ref_steps
    names = [n for n, _ in zc.tiny().named_parameters()]
    ref_masters = [plain.master_params[plain.param_names.index(n)].detach() for n in names]
    ref_scale = float(plain.get_loss_scale())
    for rank, out in enumerate(per_rank):
        for rung in RUNGS:
            steps, got_masters, scale = out[rung]["fp16"]
            assert [ok for ok, _ in steps] == [ok for ok, _ in ref_steps], (dp, rank, rung)
            assert scale == ref_scale == 512.0, (dp, rank, rung, scale)
            for step, ((_, norm), (_, ref)) in enumerate(zip(steps, ref_steps)):
                assert (norm is None) == (ref is None), (dp, rank, rung, step, norm, ref)
                assert norm is None or abs(norm - ref) <= REL * ref, (dp, rung, step, norm, ref)
            for name, g, r in zip(names, got_masters, ref_masters):
                assert zc.rel_err(g, r) <= REL, (dp, rank, rung, name, zc.rel_err(g, r))


def test_grad_and_param_bytes_are_sharded(results):
    dp, per_rank = results
    for out in per_rank:
        for rung in RUNGS:
            m = out[rung]["memory"]
            assert [n * dp for n in m["grad_numel"]] == m["buffer_numel"]
            largest = max(n for buf in m["bucket_numels"] for n in buf) * 4
            assert m["staged_after"] == 0
            assert 0 < m["staged_peak"] <= 2 * largest, (rung, m)


def test_zero3_holds_the_computed_unit_and_the_prefetched_one_in_a_training_step(results):
    """ZeRO-3's whole-parameter bytes during a training step (forward, backward, grad sync and
    the update), counted from the parameter storages at every op: the shards outside, and at
    most a unit and its neighbour in forward order at once (the one computed and the one
    prefetched: the next in forward, the previous in backward); both peaks reach that pair."""
    dp, per_rank = results
    for out in per_rank:
        m = out["optim_grads_params"]["memory"]
        (units,) = m["bucket_numels"]  # one bucket per unit (emb, fc1, norm, fc2), padded to dp
        for padded, numel in zip(units, m["unit_numels"]):
            assert numel <= padded < numel + dp
        pair = 4 * max(a + b for a, b in zip(units, units[1:]))
        assert m["step_ok"] and m["ops"]["forward"] > 0 and m["ops"]["backward"] > 0, m
        assert m["whole_before"] == 0 and m["whole_after"] == 0, m
        assert m["param_peak"]["forward"] == pair, (dp, pair, m["param_peak"])
        assert m["param_peak"]["backward"] == pair, (dp, pair, m["param_peak"])
        assert m["shard_bytes"] * dp == 4 * sum(units)


def test_zero3_checkpoints_resume_under_zero3_and_zero1_and_back(results):
    dp, per_rank = results
    for out in per_rank:
        c = out["ckpt"]
        assert all(torch.equal(a, b) for a, b in zip(c["sharded"], c["uninterrupted"]))
        for a, b in zip(c["to_zero1"], c["uninterrupted"]):
            assert zc.rel_err(a.float(), b.float()) <= 1e-2 and a.dtype == b.dtype
        assert all(torch.equal(a, b) for a, b in zip(c["to_zero1"], c["uninterrupted"]))
        assert all(torch.equal(a, b) for a, b in zip(c["from_zero1"], c["zero1"]))
