"""1-bit Adam, 0/1 Adam and 1-bit LAMB through the data-parallel wrapper.

``Tiny`` (two linears, 444 parameters: sizes that do not split evenly into DP chunks) trains on a
fixed global batch of 8 rows; rank r of DP n takes ``chunk(n)[r]`` of it.

- Warm-up: 1-bit Adam with ``freeze_step = 3`` equals AdamW bitwise for three steps (the same
  torch step on the same averaged grads), at DP 2 and 4.
- After the freeze: the params equal a one-process oracle of the algorithm (each rank's local
  grad from its rows, momenta averaged by ``reference_allreduce``, the frozen variance), 1e-5
  relative (fp32 sums in another order); the DP group carries only the compressed all-reduce, its
  bytes as ``wire_bytes`` gives them, and on the wire (``bus_factor``) at least 16x fewer than
  AdamW's fp32 all-reduce of the same grads.
- With clipping (DP 4): Adam's clip of the mean grad in the warm-up; after it, every rank's local
  grad scaled by the mean grad's coefficient (its norm from a count sketch all-reduced over DP,
  exact for 444 values), against the oracle that clips by the true mean's norm; the DP group
  carries the sketch's all-reduce (445 fp32 values) besides the compressed one.
- 0/1 Adam: the phase schedule; replicas agree after every step that communicates.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.compressed_allreduce import (
    chunk_numel,
    reference_allreduce,
    wire_bytes,
)
from megalite.core.optimizer.compressed import (
    PHASE_COMPRESSED,
    PHASE_FULL,
    PHASE_LOCAL,
    CompressionSpec,
)
from megalite.core.optimizer.loss_scaler import DynamicLossScaler
from megalite.core.optimizer.sketched_norm import sketch_size
from megalite.core.optimizer.zero_one_adam import ZeroOneAdam
from megalite.measure.comm_log import CommLog
from megalite.planning.cluster import bus_factor
from megalite.training.components import wrap_and_build_optimizer
from tests.harness import run_distributed
from tests.mesh import mesh

ROWS, LR, WD, FREEZE, STEPS = 8, 1e-2, 0.1, 3, 6
CLIP = 0.05  # below the mean grad's norm at every step: clipping acts throughout


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 40)
        self.fc2 = nn.Linear(40, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 6, generator=gen), torch.randn(ROWS, 4, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _train(
    optimizer_name: str, steps: int, *, clip_grad: float = 0.0, **options
) -> tuple[list, list, list]:
    """Params after each step, each step's CommLog records and phase, on this rank."""
    ps = mesh()
    n, rank = ps.size("dp"), ps.rank("dp")
    model, opt = wrap_and_build_optimizer(
        _model(),
        ps,
        optimizer=optimizer_name,
        lr=LR,
        weight_decay=WD,
        clip_grad=clip_grad,
        **options,
    )
    params, records, phases = [], [], []
    for step in range(steps):
        x, y = (t.chunk(n)[rank] for t in _batch(step))
        model.zero_grad_buffer()
        with CommLog() as log:
            _loss(model, x, y).backward()
            model.finish_grad_sync()
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
        records.append(log.records)
        phases.append(opt.phase if optimizer_name != "adam" else PHASE_FULL)
    return params, records, phases


def _clip(grads: list[torch.Tensor], norm: torch.Tensor, clip: float) -> list[torch.Tensor]:
    """``grads`` times Adam's global clip coefficient for ``norm`` (none without ``clip``)."""
    if clip <= 0:
        return grads
    return [g * min(1.0, clip / (float(norm) + 1e-6)) for g in grads]


def _oracle(n: int, steps: int, clip: float = 0.0) -> list[list[torch.Tensor]]:
    """1-bit Adam in one process: AdamW on the mean grad for FREEZE steps, then local grads,
    momenta averaged by the compressed all-reduce's definition, variance frozen. With ``clip``,
    every grad is clipped as Adam clips the mean grad: each rank's local grad by the coefficient
    of the mean grad's norm (the sketch is exact for Tiny's 444 values)."""
    model = _model()
    # the optimizer's order (its param groups: matrices, then biases), as the momenta are joined
    params = sorted(model.parameters(), key=lambda p: p.ndim == 1)
    decay = {
        p: (WD if p.ndim > 1 else 0.0) for p in params
    }  # megalite's groups: no decay on biases
    adam = torch.optim.AdamW([{"params": [p], "weight_decay": decay[p]} for p in params], lr=LR)
    numel = sum(p.numel() for p in params)
    worker = [torch.zeros(numel) for _ in range(n)]
    server = [torch.zeros(chunk_numel(numel, n)) for _ in range(n)]
    out = []
    for step in range(steps):
        local = []
        for r in range(n):
            model.zero_grad()
            x, y = (t.chunk(n)[r] for t in _batch(step))
            _loss(model, x, y).backward()
            local.append([p.grad.clone() for p in params])
        mean_grad = [sum(g[i] for g in local) / n for i in range(len(params))]
        norm = torch.cat([g.reshape(-1) for g in mean_grad]).norm()
        assert clip <= 0 or norm > clip, "the clip must act for the case to test it"
        if step < FREEZE:
            for p, g in zip(params, _clip(mean_grad, norm, clip)):
                p.grad = g
            adam.step()
        else:
            local = [_clip(grads, norm, clip) for grads in local]
            momenta = []
            for r in range(n):
                m = [
                    0.9 * adam.state[p]["exp_avg"] + 0.1 * local[r][i] for i, p in enumerate(params)
                ]
                momenta.append(torch.cat([t.reshape(-1) for t in m]))
            mean = reference_allreduce(momenta, worker, server)
            t = step + 1
            offset = 0
            with torch.no_grad():
                for p in params:
                    state = adam.state[p]
                    state["exp_avg"] = mean[offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                    # v frozen after FREEZE updates, with the bias correction of its last
                    denom = (state["exp_avg_sq"] / (1 - 0.999**FREEZE)).sqrt() + 1e-8
                    p.mul_(1 - LR * decay[p])
                    p.sub_(LR / (1 - 0.9**t) * state["exp_avg"] / denom)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _onebit_case(clip: float) -> None:
    n = dist.get_world_size()
    spec = CompressionSpec(freeze_step=FREEZE)
    got, records, _ = _train("onebit-adam", STEPS, clip_grad=clip, compression=spec)
    plain, plain_records, _ = _train("adam", FREEZE, clip_grad=clip)
    for step in range(FREEZE):  # warm-up: bitwise
        for a, b in zip(got[step], plain[step]):
            assert torch.equal(a, b), f"warm-up step {step + 1} differs from AdamW"
    want = _oracle(n, STEPS, clip)
    for step in range(FREEZE, STEPS):
        for a, b in zip(got[step], want[step]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    numel = sum(p.numel() for p in _model().parameters())
    fp32 = sum(bus_factor(op, size) * b for op, size, b in plain_records[0] if size == n)
    assert fp32 == bus_factor("all_reduce", n) * 4 * numel
    sketch = {"all_reduce": 4 * (sketch_size(numel) + 1)} if clip > 0 else {}
    for step in range(FREEZE, STEPS):
        dp = [(op, b) for op, size, b in records[step] if size == n]
        assert {op for op, _ in dp} == {"all_to_all", "all_gather", *sketch}
        assert sum(b for op, b in dp if op != "all_reduce") == wire_bytes(numel, n)
        assert {op: b for op, b in dp if op == "all_reduce"} == sketch
        if not clip:
            wire = sum(bus_factor(op, n) * b for op, b in dp)
            assert fp32 / wire >= 16, (fp32, wire)


@pytest.mark.parametrize("dp, clip", [(2, 0.0), (4, CLIP)])
def test_onebit_adam_warmup_bitwise_then_oracle(dp: int, clip: float) -> None:
    """At DP 4 clipping acts at every step: the compressed steps' local grads are scaled by the
    mean grad's coefficient (each rank's own norm would be larger and differ by rank)."""
    run_distributed(_onebit_case, dp, clip)


def test_zero_one_adam_schedule() -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = ZeroOneAdam(
        [p],
        lr=1.0,
        var_freeze_step=8,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        dp_group=None,
    )
    phases = []
    for _ in range(20):
        phases.append(opt.phase_of(opt.step_count + 1))
        p.grad = torch.ones(3)
        opt.step()
    F, C, L = PHASE_FULL, PHASE_COMPRESSED, PHASE_LOCAL
    # variance at 1, 2 (interval 1), 4, 6 (interval 2), then 10 is past the freeze;
    # a sync every step to 8, then every 1 (9), 2 (11), 4 (15, 19) steps
    want = [F, F, C, F, C, F, C, C, C, L, C, L, L, L, C, L, L, L, C, L]
    assert phases == want


def _zero_one_case() -> None:
    spec = CompressionSpec(
        var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2
    )
    params, records, phases = _train("zero-one-adam", 7, compression=spec)
    F, C, L = PHASE_FULL, PHASE_COMPRESSED, PHASE_LOCAL
    assert phases == [F, C, F, L, C, L, C]
    n = dist.get_world_size()
    numel = sum(p.numel() for p in _model().parameters())
    sent_by_phase = {F: 4 * numel, C: wire_bytes(numel, n), L: 0}
    for step, ps in enumerate(params):
        sent = sum(b for _, size, b in records[step] if size == n)
        assert sent == sent_by_phase[phases[step]], f"step {step + 1}"
        flat = torch.cat([p.reshape(-1) for p in ps])
        gathered = [torch.zeros_like(flat) for _ in range(n)]
        dist.all_gather(gathered, flat)
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        assert same == (phases[step] != L), f"step {step + 1}: replicas agree: {same}"


def test_zero_one_adam_replicas_agree_after_syncs() -> None:
    run_distributed(_zero_one_case, 2)


def _zero_one_clip_case() -> None:
    """The norm each 0/1 Adam step clips by (the one ``step`` returns), against the grads this
    test gathers: the mean grad's in a full step (the wrapper's all-reduce) and in a compressed one
    (the sketch, exact for 444 values); in a local one the rank's own norm times the ratio of the
    mean's norm to the rms of the ranks' own norms at the last compressed step."""
    ps = mesh()
    n, rank = ps.size("dp"), ps.rank("dp")
    spec = CompressionSpec(
        var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2
    )
    options = {"lr": LR, "weight_decay": WD, "clip_grad": CLIP, "compression": spec}
    model, opt = wrap_and_build_optimizer(_model(), ps, optimizer="zero-one-adam", **options)
    ratio = 1.0
    for step in range(7):
        x, y = (t.chunk(n)[rank] for t in _batch(step))
        model.zero_grad_buffer()
        _loss(model, x, y).backward()
        model.finish_grad_sync()
        own = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()])
        grads = [torch.zeros_like(own) for _ in range(n)]
        dist.all_gather(grads, own)
        mean = float((sum(grads) / n).norm())
        rms = float(torch.stack([g.norm() for g in grads]).square().mean().sqrt())
        norm = float(opt.step()[1])
        # a full step's grads are the mean already
        want = float(own.norm()) * ratio if opt.phase == PHASE_LOCAL else mean
        if opt.phase == PHASE_COMPRESSED:
            ratio = mean / rms
        assert abs(norm - want) <= 1e-5 * want, (step + 1, opt.phase, norm, want)
        assert mean > CLIP, "the clip must act for the case to test it"


def test_zero_one_adam_clips_by_the_mean_grads_norm() -> None:
    run_distributed(_zero_one_clip_case, 2)


def _skip_case() -> list[bool]:
    """Compressed from step 2; at step 2 only rank 1's local grad holds an inf: with local grads
    the skip decision must still be every rank's (the flag max-reduced over DP)."""
    ps = mesh()
    model, opt = wrap_and_build_optimizer(
        _model(),
        ps,
        optimizer="onebit-adam",
        compression=CompressionSpec(freeze_step=1),
        lr=LR,
        weight_decay=WD,
        clip_grad=0.0,
        loss_scaler=DynamicLossScaler(1.0, hysteresis=1),
    )
    done = []
    for step in range(2):
        x, y = (t.chunk(ps.dp_size)[ps.rank("dp")] for t in _batch(step))
        model.zero_grad_buffer()
        _loss(model, x, y).backward()
        model.finish_grad_sync()
        if step == 1 and ps.rank("dp") == 1:
            next(model.parameters()).main_grad[0, 0] = float("inf")
        done.append(opt.step()[0])
    return done


def test_overflow_on_one_rank_skips_on_every_rank() -> None:
    assert run_distributed(_skip_case, 2) == [[True, False], [True, False]]


def test_zero_one_adam_variance_counts_its_own_updates_in_one_process() -> None:
    """0/1 Adam on one rank (the compressed all-reduce of a group of one is still sign and scale
    with error feedback) against a hand-written oracle: the variance moves only at its steps (1,
    3, 7 here) and its bias correction counts those updates, not the steps."""
    torch.manual_seed(0)
    w0, grads = torch.randn(7), [torch.randn(7) for _ in range(9)]
    p = nn.Parameter(w0.clone())
    b1, b2, lr, eps = 0.9, 0.999, 0.1, 1e-8
    opt = ZeroOneAdam(
        [p],
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=0.0,
        var_freeze_step=9,
        var_update_scaler=1,
        local_step_scaler=1,
        local_step_clipper=1,
        dp_group=None,
    )
    w, m, v, k = w0.clone(), torch.zeros(7), torch.zeros(7), 0
    worker, server = [torch.zeros(7)], [torch.zeros(chunk_numel(7, 1))]
    for t, g in enumerate(grads, start=1):
        full = opt.phase_of(t) == PHASE_FULL
        p.grad = g.clone()
        opt.step()
        m = b1 * m + (1 - b1) * g
        lr_t = lr / (1 - b1**t)
        if full:
            v, k = b2 * v + (1 - b2) * g * g, k + 1
        denom = (v / (1 - b2**k)).sqrt() + eps
        if full:
            w = w - lr_t * m / denom
        else:
            u = reference_allreduce([lr_t * m], worker, server)
            w, m = w - u / denom, u / lr_t
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6, msg=f"step {t}")
    assert k == 3 and opt.var_updates == 3
