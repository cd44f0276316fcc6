"""The model-state memory of every rank (params, grads, fp32 masters, optimizer states) at start-up.

Measured over tensor *storage*: each distinct storage counted once (a ZeRO-1 param buffer, the
grad buffers, the flat master and Adam shards), so views and aliases are not double-counted, and a
master that *is* the model parameter (fp32 training) costs nothing extra. Adam states that the
plain ``torch.optim.AdamW`` creates lazily at its first step are counted at the size it will
allocate (two fp32 tensors per master). ``step`` counters (4 bytes per tensor) are included.

Theory for ``P`` parameters on this model-parallel rank, DP size ``d``, params of ``p`` bytes and
grads of ``g`` bytes per element::

    plain:   p P + g P + (m + 8) P          m = 4 for 16-bit params (fp32 master), 0 for fp32
    ZeRO-1:  p P + g P + (m + 8) P / d      (e.g. bf16 params, fp32 grads: 2P + 4P + 12P/d)

ZeRO-1's measured optimizer bytes exceed the theory only by the bucket padding (< d elements per
bucket) and the step counters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.tensor_parallel.mappings import group_size

logger = logging.getLogger(__name__)
MIB = 2**20


@dataclass
class ModelStateBytes:
    """Bytes on one rank; ``theory`` is the formula of the module docstring."""

    params: int
    grads: int
    master: int
    optimizer: int
    theory: int
    num_params: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


def _storages(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> dict[int, int]:
    """data_ptr -> nbytes of each distinct storage of ``tensors`` not in ``exclude``."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            out[storage.data_ptr()] = storage.nbytes()
    return out


def model_state_bytes(model: nn.Module, optimizer, *, dp_size: int) -> ModelStateBytes:
    """Measure ``model`` (a DP wrapper with ``grad_buffers``) and ``optimizer`` (either optimizer:
    ``master_params`` and the inner ``optimizer``) on this rank; ``dp_size`` for the theory."""
    params = [p for p in model.parameters() if p.requires_grad]
    param_st = _storages(params)
    grad_st = _storages([b.data for b in model.grad_buffers])
    master_st = _storages(optimizer.master_params, exclude=set(param_st))
    seen = set(param_st) | set(master_st)
    inner = optimizer.optimizer
    state_tensors, lazy = [], 0
    for master in optimizer.master_params:
        state = inner.state.get(master, {})
        if not state:  # plain AdamW: exp_avg + exp_avg_sq + step at the first step
            lazy += 2 * master.numel() * 4 + 4
        state_tensors += [v for v in state.values() if torch.is_tensor(v)]
    optim_st = _storages(state_tensors, exclude=seen)

    zero = optimizer.is_sharded
    num_params, theory = 0, 0.0
    for p in params:
        n, p_size = p.numel(), p.element_size()
        g_size = p.main_grad.element_size() if hasattr(p, "main_grad") else p_size
        master = 0 if p.dtype == torch.float32 else 4
        num_params += n
        theory += n * (p_size + g_size) + n * (master + 8) / (dp_size if zero else 1)
    return ModelStateBytes(
        params=sum(param_st.values()),
        grads=sum(grad_st.values()),
        master=sum(master_st.values()),
        optimizer=sum(optim_st.values()) + lazy,
        theory=round(theory),
        num_params=num_params,
    )


def theory_formula(model: nn.Module, *, dp_size: int, zero: bool) -> str:
    """The theory as text for the first parameter's dtypes, e.g. ``2P + 4P + 12P/4``."""
    p = next(p for p in model.parameters() if p.requires_grad)
    g = p.main_grad.element_size() if hasattr(p, "main_grad") else p.element_size()
    rest = (0 if p.dtype == torch.float32 else 4) + 8
    return f"{p.element_size()}P + {g}P + {rest}P" + (f"/{dp_size}" if zero else "")


def _gather_rows(row: torch.Tensor, groups) -> torch.Tensor:
    """All-gather ``row`` [k] over each group in turn -> [ranks, k] (every rank of the product)."""
    rows = row.unsqueeze(0)
    for group in groups:
        n = group_size(group)
        if n > 1:
            out = [torch.empty_like(rows) for _ in range(n)]
            dist.all_gather(out, rows, group=group)
            rows = torch.cat(out)
    return rows


def log_model_state_memory(model: nn.Module, optimizer, ps) -> list[ModelStateBytes]:
    """Measure every rank (a collective over the model-parallel and DP groups) and log one line
    per rank on the logging rank. Returns the per-rank numbers, global-rank order."""
    mine = model_state_bytes(model, optimizer, dp_size=ps.dp_size)
    row = torch.tensor([ps.rank(), *astuple(mine)], dtype=torch.float64, device=ps.device)
    rows = _gather_rows(row, (ps.mp_group, ps.dp_group)).cpu()
    rows = rows[rows[:, 0].argsort()]
    zero = optimizer.is_sharded
    logger.info(
        "model-state memory per rank (%s): params + grads + fp32 master + optimizer states "
        "(MiB), measured vs theory %s (P = params on the rank)",
        f"ZeRO-1 over DP {ps.dp_size}" if zero else "optimizer replicated over DP",
        theory_formula(model, dp_size=ps.dp_size, zero=zero),
    )
    out = []
    for r in rows.tolist():
        s = ModelStateBytes(*(int(v) for v in r[1:]))
        out.append(s)
        logger.info(
            "  rank %d: %.2f + %.2f + %.2f + %.2f = %.2f MiB (theory %.2f MiB, %d params)",
            int(r[0]), s.params / MIB, s.grads / MIB, s.master / MIB, s.optimizer / MIB,
            s.total / MIB, s.theory / MIB, s.num_params,
        )  # fmt: skip
    return out
