"""Which inner AdamW path the optimizer builders take: torch's fused kernel only when every master
is on CUDA (tests/test_cuda_only.py checks the fused step itself against the default one)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from megalite.core.optimizer import build_optimizer
from megalite.core.optimizer.builders import fused_adam_serves


def _on(*types: str) -> list[dict]:
    return [{"params": [SimpleNamespace(device=torch.device(t)) for t in types]}]


def test_fused_only_when_every_master_is_on_cuda():
    assert fused_adam_serves(_on("cuda", "cuda"))
    assert fused_adam_serves(_on("cuda") + _on("cuda"))
    assert not fused_adam_serves(_on("cpu"))
    assert not fused_adam_serves(_on("cuda", "cpu"))  # a part held on the host
    assert not fused_adam_serves(_on("cuda") + _on("cpu"))
    assert not fused_adam_serves(_on("meta"))
    assert not fused_adam_serves([{"params": []}])


def test_cpu_masters_keep_the_default_adamw():
    opt = build_optimizer(nn.Linear(4, 4), lr=1e-3, weight_decay=0.1)
    assert not any(g.get("fused") for g in opt.optimizer.param_groups)
