"""The model-state memory of every rank (params, grads, fp32 masters, optimizer states, buffers)
at start-up, per rung of the ZeRO ladder, and the measured peak after the first step.

Measured over tensor *storage*: each distinct storage counted once (a param buffer, the
grad buffers or their shards, the flat master and Adam shards), so views and aliases are not
double-counted, and a master that *is* the model parameter (fp32 training) costs nothing extra.
Adam states that the plain ``torch.optim.AdamW`` creates lazily at its first step are counted at
the size it will allocate (two fp32 tensors per master). ``step`` counters (4 bytes per tensor) are
included. Offloaded optimizer state is reported apart: ``host`` (host storages, or the NVMe
stream's host buffers) and ``disk`` (the state files). ``buffers``: grad buckets being staged
(ZeRO-2/3) and whole ZeRO-3 units gathered, now; after the first step their peak.

Theory for ``P`` parameters on this model-parallel rank, DP size ``N``, params of ``p`` bytes,
grads of ``g`` bytes and ``k = 8 + (4 if the params are 16-bit: the fp32 master)`` optimizer bytes
per element; stage ``z`` divides by ``N`` the first ``z`` of (optimizer, grads, params)::

    stage 0 (no_shard):            p P   + g P   + k P
    stage 1 (optim):               p P   + g P   + k P / N
    stage 2 (optim_grads):         p P   + g P/N + k P / N
    stage 3 (optim_grads_params):  p P/N + g P/N + k P / N

Under bf16 params the grads are fp32 by default (``accumulate_allreduce_grads_in_fp32``, as
Megatron's, g = 4): 18P, 6P + 12P/N, 2P + 16P/N, 18P/N. DeepSpeed's figures are the bf16-grad
case (``grad_reduce_in_bf16``: p = g = 2, k = 12): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N.
With offload, ``fraction`` of the optimizer part moves to the host (or disk); ZeRO-3's parameter
offload moves its ``p P/N`` to the host (or disk: fp32 params in files are the master file, so
their bytes are counted once, as params), and with the whole optimizer state offloaded its
``g P/N`` grad shards go to the host. ``theory`` is the device part, ``theory_off`` the rest.
Measured bytes exceed the theory only by bucket padding (< N elements per bucket), the step
counters and the units kept whole (the persistent bucket of parameters in no unit).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from megalite.core.distributed import STRATEGIES, DistributedDataParallel, Zero3DataParallel
from megalite.core.distributed.param_offload import ParamFile
from megalite.core.groups import group_size
from megalite.core.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.core.parallel_state import ParallelState

logger = logging.getLogger(__name__)
MIB = 2**20


@dataclass
class ModelStateBytes:
    """Bytes on one rank; ``theory`` is the device formula of the module docstring, ``theory_off``
    the offloaded state's (host or disk). ``host`` / ``disk``: the optimizer state's;
    ``params_host`` / ``params_disk`` / ``grads_host`` / ``grads_disk``: ZeRO-3's offloaded
    shards."""

    params: int
    grads: int
    master: int
    optimizer: int
    theory: int
    num_params: int
    host: int = 0
    disk: int = 0
    buffers: int = 0
    theory_off: int = 0
    stage: int = 0
    params_host: int = 0
    params_disk: int = 0
    grads_host: int = 0
    grads_disk: int = 0

    @property
    def total(self) -> int:
        """Device bytes: params + grads + masters + optimizer states + buffers."""
        return self.params + self.grads + self.master + self.optimizer + self.buffers


def _storages(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> dict[int, int]:
    """data_ptr -> nbytes of each distinct storage of ``tensors`` not in ``exclude``."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude and storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def model_state_bytes(
    model: DistributedDataParallel, optimizer: MixedPrecisionOptimizer, *, dp_size: int
) -> ModelStateBytes:
    """Measure ``model`` (a data-parallel wrapper, any rung) and ``optimizer`` (either optimizer:
    ``master_params`` and the inner ``optimizer``) on this rank; ``dp_size`` for the theory."""
    params = [p for p in model.parameters() if p.requires_grad]
    store = model.param_store if isinstance(model, Zero3DataParallel) else None
    host_grads = model.host_grads if isinstance(model, Zero3DataParallel) else []
    grad_files = store.grad_files if store is not None else []
    grads_off = bool(host_grads) or bool(grad_files)
    shards = [s for s in model.param_shards.values() if not isinstance(s, ParamFile)]
    params_host_st = {}
    if store is not None and store.place != "device":  # the shards (or the file staging)
        params_host_st = _storages(store.host_tensors())
        shards = []
    param_st = _storages([*params, *shards], exclude=set(params_host_st))
    grads_host_st = _storages(host_grads)
    grad_st = _storages([b.data for b in model.grad_buffers], exclude=set(grads_host_st))
    states = optimizer.buffers if optimizer.is_sharded else []  # ShardState per buffer
    host_tensors = [t for sb in states for t in sb.host.values()]
    host_tensors += [t for sb in states if sb.store is not None for t in sb.store.buffers.values()]
    host_st = _storages(host_tensors, exclude=set(params_host_st) | set(grads_host_st))
    param_files = {f.path for f in (store.files if store is not None else [])}
    stores = [sb.store for sb in states if sb.store is not None]
    optim_files = {path for s in stores for path in s.paths.values()} - param_files
    disk = sum(os.path.getsize(path) for path in optim_files)
    off_st = set(host_st) | set(params_host_st)
    master_st = _storages(optimizer.master_params, exclude=set(param_st) | off_st)
    seen = set(param_st) | set(master_st) | off_st
    inner = optimizer.optimizer
    state_tensors, lazy = [], 0
    for master in optimizer.master_params:
        state = inner.state.get(master, {})
        if not state:  # plain AdamW: exp_avg + exp_avg_sq + step at the first step
            lazy += 2 * master.numel() * 4 + 4
        state_tensors += [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    optim_st = _storages(state_tensors, exclude=seen)
    steps = sum(4 for m in optimizer.master_params if "step" in inner.state.get(m, {}))
    buffers = model.staged_bytes()

    stage = model.zero_stage
    fraction = 0.0
    if states and states[0].numel:
        fraction = sum(sb.cut for sb in states) / sum(sb.numel for sb in states)
    params_off = store is not None and store.place != "device"
    num_params, theory, theory_off = 0, 0.0, 0.0
    for p in params:
        n, p_size = p.numel(), p.element_size()
        g_size = model.buffer_of(p).grad_dtype.itemsize
        k = 8 + (0 if p.dtype == torch.float32 else 4)
        num_params += n
        param_bytes = n * p_size / (dp_size if stage >= 3 else 1)
        grad_bytes = n * g_size / (dp_size if stage >= 2 else 1)
        optim = n * k / (dp_size if stage >= 1 else 1)
        theory += (0 if params_off else param_bytes) + (0 if grads_off else grad_bytes)
        theory_off += (param_bytes if params_off else 0) + (grad_bytes if grads_off else 0)
        theory += optim * (1 - fraction)
        theory_off += optim * fraction
    return ModelStateBytes(
        params=sum(param_st.values()),
        grads=sum(grad_st.values()),
        master=sum(master_st.values()),
        optimizer=sum(optim_st.values()) + lazy + steps,
        theory=round(theory),
        num_params=num_params,
        host=sum(host_st.values()),
        disk=disk,
        buffers=buffers,
        theory_off=round(theory_off),
        stage=stage,
        params_host=sum(params_host_st.values()),
        params_disk=sum(os.path.getsize(path) for path in param_files),
        grads_host=sum(grads_host_st.values()),
        grads_disk=sum(os.path.getsize(f.path) for f in grad_files),
    )


def theory_formula(model: DistributedDataParallel, *, dp_size: int) -> str:
    """The theory as text for the first parameter's dtypes, e.g. ``2P + 4P/4 + 12P/4``."""
    stage = model.zero_stage
    p = next(p for p in model.parameters() if p.requires_grad)
    g = model.buffer_of(p).grad_dtype.itemsize
    k = (0 if p.dtype == torch.float32 else 4) + 8
    parts = [(p.element_size(), 3), (g, 2), (k, 1)]
    return " + ".join(f"{b}P" + (f"/{dp_size}" if stage >= z else "") for b, z in parts)


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


# "no_shard", "ZeRO-1 (optim)", ..., by stage
STAGE_NAMES = ("no_shard", *(f"ZeRO-{z} ({s})" for z, s in enumerate(STRATEGIES) if z))


def log_model_state_memory(
    model: DistributedDataParallel, optimizer: MixedPrecisionOptimizer, ps: ParallelState
) -> list[ModelStateBytes]:
    """Measure every rank (a collective over the model-parallel and DP groups) and log one line
    per rank on the logging rank. Returns the per-rank numbers, global-rank order."""
    mine = model_state_bytes(model, optimizer, dp_size=ps.size("dp", "cp"))
    rows = _rows(mine, ps)
    logger.info(
        "model-state memory per rank, %s over DP %d: params + grads + fp32 master + optimizer "
        "states + buffers (MiB, device) [+ offloaded host / disk], measured vs theory %s "
        "(P = params on the rank; DeepSpeed's rungs: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N)",
        STAGE_NAMES[mine.stage],
        ps.size("dp", "cp"),
        theory_formula(model, dp_size=ps.size("dp", "cp")),
    )
    for r, s in rows:
        off = _offloaded(s)
        theory_off = f" + {s.theory_off / MIB:.2f} off" if s.theory_off else ""
        logger.info(
            "  rank %d: %.2f + %.2f + %.2f + %.2f + %.2f = %.2f MiB%s "
            "(theory %.2f MiB%s, %d params)",
            *(r, *_mib_columns(s), off, s.theory / MIB, theory_off, s.num_params),
        )
    return [s for _, s in rows]


def _offloaded(s: ModelStateBytes) -> str:
    """`` [+ host params a / grads b / optimizer c, disk params d / grads e / optimizer f]``
    (MiB), or nothing when nothing is offloaded."""
    host = (s.params_host, s.grads_host, s.host)
    disk = (s.params_disk, s.grads_disk, s.disk)
    if not any(host) and not any(disk):
        return ""
    names = ("params", "grads", "optimizer")
    h = " / ".join(f"{n} {b / MIB:.2f}" for n, b in zip(names, host))
    d = " / ".join(f"{n} {b / MIB:.2f}" for n, b in zip(names, disk))
    return f" [+ host {h}, disk {d}]"


def _mib_columns(s: ModelStateBytes) -> list[float]:
    """params, grads, master, optimizer, buffers and their total, in MiB (the logged columns)."""
    return [x / MIB for x in (s.params, s.grads, s.master, s.optimizer, s.buffers, s.total)]


def _rows(mine: ModelStateBytes, ps) -> list[tuple[int, ModelStateBytes]]:
    row = torch.tensor([ps.rank(), *astuple(mine)], dtype=torch.float64, device=ps.device)
    rows = _gather_rows(row, (ps.mp_group, ps.group("dp", "cp"))).cpu()
    rows = rows[rows[:, 0].argsort()]
    return [(int(r[0]), ModelStateBytes(*(int(v) for v in r[1:]))) for r in rows.tolist()]


def log_memory_after_step(
    model: DistributedDataParallel, optimizer: MixedPrecisionOptimizer, ps: ParallelState
) -> list[ModelStateBytes]:
    """After the first step (a collective): per rank the measured bytes with ``buffers`` = the
    peak of staged grad buckets + gathered ZeRO-3 units during it (and the CUDA allocator's peak
    when on a GPU)."""
    mine = model_state_bytes(model, optimizer, dp_size=ps.size("dp", "cp"))
    mine.buffers = model.staged_peak_bytes + model.param_peak_bytes
    rows = _rows(mine, ps)
    cuda = ""
    if torch.cuda.is_available() and ps.device.type == "cuda":
        cuda = (
            f"; CUDA peak allocated on this rank "
            f"{torch.cuda.max_memory_allocated(ps.device) / MIB:.1f} MiB, reserved "
            f"{torch.cuda.max_memory_reserved(ps.device) / MIB:.1f} MiB"
        )
    logger.info("model-state memory measured after the first step (buffers = their peak)%s", cuda)
    for r, s in rows:
        logger.info(
            "  rank %d: %.2f + %.2f + %.2f + %.2f + %.2f = %.2f MiB (theory %.2f MiB + buffers)",
            *(r, *_mib_columns(s), s.theory / MIB),
        )
    return [s for _, s in rows]
