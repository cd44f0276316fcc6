"""LayerNorm and RMSNorm modules that run on whatever shard they are given.

Under sequence parallelism a norm sees ``[s/tp, b, h]``: its weight is replicated over TP but each
rank computes a grad from a different part of the sequence, so the parameters are marked
``sequence_parallel = True`` and their grads are all-reduced over the TP group by the grad-sync
step (``megalite.core.distributed.sp_grads``). The math goes through ``megalite.core.fusions``.

``zero_centered_gamma`` (the model's ``apply_layernorm_1p``): the weight is stored as ``w - 1``
(initialised to zeros, so weight decay pulls the scale towards 1) and applied as ``1 + w``, in the
weight's dtype as Megatron's local norm does; the fused kernels and the reference see the same
``1 + w``, so they give the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core import fusions


def _mark(param: nn.Parameter, sequence_parallel: bool) -> None:
    param.sequence_parallel = sequence_parallel
    param.tensor_model_parallel = False
    param.partition_dim = None


class LayerNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        use_fused: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        zero_centered_gamma: bool = False,
    ):
        super().__init__()
        self.eps, self.use_fused = eps, use_fused
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        _mark(self.weight, sequence_parallel)
        _mark(self.bias, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return fusions.layer_norm(x, weight, self.bias, self.eps, use_fused=self.use_fused)


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        use_fused: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        zero_centered_gamma: bool = False,
    ):
        super().__init__()
        self.eps, self.use_fused = eps, use_fused
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=params_dtype, device=device))
        _mark(self.weight, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return fusions.rms_norm(x, weight, self.eps, use_fused=self.use_fused)


def build_norm(
    kind: str,
    hidden_size: int,
    *,
    eps: float,
    sequence_parallel: bool,
    use_fused: bool = True,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    zero_centered_gamma: bool = False,
) -> nn.Module:
    """``kind`` is the ``normalization`` of the model config: ``LayerNorm`` or ``RMSNorm``;
    ``zero_centered_gamma``: see the module docstring."""
    classes = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
    if kind not in classes:
        raise ValueError(f"normalization must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind](
        hidden_size,
        eps=eps,
        sequence_parallel=sequence_parallel,
        use_fused=use_fused,
        params_dtype=params_dtype,
        device=device,
        zero_centered_gamma=zero_centered_gamma,
    )
