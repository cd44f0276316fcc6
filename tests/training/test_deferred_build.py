"""A GPT built on the meta device and filled unit by unit from keyed-init twins
(``core.distributed.deferred_init``, ``GPTModel.build_twin``), with its ZeRO-3 param shards, grads
and optimizer state in files.

- World 1 and DP 2, both families: the filled params equal a normal CPU build's bit for bit (the
  gathered state dict against ``GPTModel`` on ``ParallelState.single()``), each unit's twin is
  built once, and 2 fp32 steps give exactly the losses and grad norms of the same ZeRO-3 set-up
  built normally.
- ``build_model`` leaves the values to ZeRO-3 (parameters without bytes) when the flags offload
  ZeRO-3's param shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.distributed import ParamOffloadSpec
from megalite.core.distributed.deferred_init import is_released, release_params
from megalite.core.optimizer import OffloadSpec
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from megalite.training.components import build_model, gpt_units, wrap_and_build_optimizer
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, config

Z3 = "optim_grads_params"
STEPS = 2


def build(model_cfg, ps, directory: str, *, meta: bool):
    """ZeRO-3, params and optimizer in files (1 KiB of param staging: units streamed in pieces),
    grads on the host; ``meta``: built on the meta device and filled from twins."""
    module = GPTModel(model_cfg, ps, device=torch.device("meta") if meta else None)
    twins = []
    if meta:
        release_params(module, torch.device("cpu"))
        build_twin = module.build_twin
        module.build_twin = lambda unit, ps: twins.append(unit) or build_twin(unit, ps)
    model, opt = wrap_and_build_optimizer(
        module,
        ps,
        strategy=Z3,
        param_offload=ParamOffloadSpec(directory=f"{directory}/param", host_bytes=1024),
        grad_offload=True,
        offload=OffloadSpec(directory=f"{directory}/optim", host_bytes=24 * 64),
        lr=1e-2,
        weight_decay=0.01,
        clip_grad=1.0,
    )
    return module, model, opt, twins


def steps(model, opt, dp_rank: int) -> list[tuple[float, float]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # this DP rank's micro-batch
        tokens = torch.randint(0, 127, (2, 16), generator=g)
        labels = torch.randint(0, 127, (2, 16), generator=g)
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens, None, labels).mean()
        loss.backward()
        model.finish_grad_sync()
        _, norm, _ = opt.step()
        out.append((loss.item(), norm.item()))
    return out


def deferred_case(tmp: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for family, flags in FAMILIES.items():
        model_cfg = config(*flags).model
        ps = mesh()
        try:
            normal = build(model_cfg, ps, f"{tmp}/{family}/normal{rank}", meta=False)
            meta = build(model_cfg, ps, f"{tmp}/{family}/meta{rank}", meta=True)
            module, model, opt, twins = meta
            units = [u for u in gpt_units(module)[0] if any(True for _ in u.parameters())]
            out[family] = {
                "state": model.state_dict(),
                "twins_once": len(twins) == len(units)
                and all(a is b for a, b in zip(twins, units)),
                "normal": steps(normal[1], normal[2], ps.dp_rank),
                "meta": steps(model, opt, ps.dp_rank),
            }
        finally:
            ps.destroy()
    return out


def test_meta_build_filled_from_twins_equals_a_normal_build(tmp_path):
    oracles = {}
    for family, flags in FAMILIES.items():
        oracles[family] = GPTModel(config(*flags).model, ParallelState.single()).state_dict()
    for world in (1, 2):
        for rank_out in run_distributed(deferred_case, world, str(tmp_path / f"w{world}")):
            for family, got in rank_out.items():
                want = oracles[family]
                assert sorted(got["state"]) == sorted(want), family
                for name, value in want.items():
                    assert torch.equal(got["state"][name], value), (world, family, name)
                assert got["twins_once"], (world, family)
                assert got["meta"] == got["normal"], (world, family, got)


def test_build_model_leaves_the_values_to_zero3_with_param_offload(tmp_path):
    flags = ("--zero-stage", "3", "--param-offload-dir", str(tmp_path / "p"))
    flags += ("--optimizer-offload-dir", str(tmp_path / "o"))
    cpu = torch.device("cpu")
    deferred = build_model(config(*flags), ParallelState.single(), device=cpu, rng_tracker=None)
    assert all(is_released(p) for p in deferred.parameters())
    normal = build_model(
        config("--zero-stage", "3"), ParallelState.single(), device=cpu, rng_tracker=None
    )
    assert not any(is_released(p) for p in normal.parameters())
