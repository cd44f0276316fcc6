"""Save a checkpoint in Megatron's layout (DESIGN §5) from explicit pieces, under any layout.

    save_checkpoint(save_dir, iteration, model_chunks=[gpt], optimizer=optimizer,
                    scheduler=scheduler, ps=ps, consumed_train_samples=n, config_record=record,
                    rng_tracker=tracker, device=device)

What each rank writes (``files`` has the paths): the first DP rank of every (TP, PP) coordinate
writes ``model_optim_rng.pt`` = the model shard, the plain optimizer's state (fp32 masters and
Adam moments, keyed by parameter name), the LR scheduler, iteration, consumed samples, the run's
recorded config, its layout, and every DP rank's RNG states (gathered over DP). Under ZeRO-1 every
DP rank also writes its own range, ``distrib_optim_{dp:03d}.pt``. Each rank fsyncs its files; after
a world-wide all-reduce (everyone has written) rank 0 replaces the tracker atomically.

Collective: every rank calls it at the same iteration boundary (the exit-signal handler may, too).
It communicates over ``ps.group()`` (every rank: the barriers around the write and the confirmation
before the tracker is replaced) and ``ps.group("dp", "cp")`` (the RNG states); it returns when the
checkpoint is complete and the tracker names it.

A save is three steps: ``prepare_save`` (every collective but the commit; no file yet),
``write_pending`` (this rank's files: no collective, so a background thread may run it, as
``async_save`` does) and ``commit_checkpoint`` (every rank's files are complete: the tracker).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megalite.checkpoint.chunks import check_chunks, stage_table
from megalite.checkpoint.experts import expert_file, gather_expert_optimizer
from megalite.checkpoint.files import (
    MODEL_FILE,
    CheckpointError,
    distrib_optim_file,
    dp_rank_optim_file,
    fsync_dir,
    iteration_dir,
    read_tracker,
    remove_old_checkpoints,
    save_file,
    shard_dir,
    write_failure,
    write_tracker,
)
from megalite.checkpoint.records import capture_rng_state, layout_record, plain_data, shard_header
from megalite.core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def world_sum(value: float, ps: ParallelState) -> float:
    """Sum over every rank (``ps.group()``; also a barrier); the value itself on a world of one."""
    if ps.size() == 1 or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ps.device)
    dist.all_reduce(t, group=ps.group())
    return float(t.item())


def gather_over_dp(obj: object, ps: ParallelState) -> list:
    """``obj`` of every rank of this rank's data-parallel group (``ps.group("dp", "cp")``), in
    DP order."""
    if ps.size("dp", "cp") == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * ps.size("dp", "cp")
    dist.all_gather_object(out, obj, group=ps.group("dp", "cp"))
    return out


def _layout(chunks: list[nn.Module], optimizer, ps: ParallelState, table) -> dict:
    module = chunks[0]
    several = table is not None  # several chunks: every global stage and its (pp rank, chunk)
    layer_ranges, stage_ranks = table if several else (None, None)
    return layout_record(
        tp_size=ps.tp_size,
        pp_size=ps.pp_size,
        dp_size=ps.size("dp", "cp"),
        tp_rank=ps.tp_rank,
        pp_rank=ps.pp_rank,
        layer_ranges=layer_ranges if several else module.config.stage_layer_ranges(ps.pp_size),
        padded_vocab_size=module.padded_vocab_size,
        distributed_optimizer=optimizer.is_sharded,
        stage_ranks=stage_ranks if several else None,
        tp_mode=ps.sizes.tp_mode,
        tp_depth=ps.sizes.tp_depth,
    )


def optimizer_full_state(optimizer) -> dict:
    """The plain optimizer's state keyed by parameter name, as written into
    ``model_optim_rng.pt``: ``full_state_dict(copy=False)``, views of the live tensors (no copy
    in memory), so save it before the next step."""
    return optimizer.full_state_dict(copy=False)


def checked_parameters(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The (name, parameter) pairs of ``chunks`` a save checks for NaN/inf: the floating ones
    that hold values."""
    return [
        (n, p)
        for m in chunks
        for n, p in m.named_parameters()
        if p.is_floating_point() and p.numel()
    ]


def non_finite_parameters(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters holding a NaN or an inf (one host read for all)."""
    return non_finite(checked_parameters([module]))


def non_finite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating, non-empty tensors of ``named`` holding a NaN or an inf (one
    host read for all). A tensor is finite when its minimum and maximum are (a NaN anywhere makes
    both NaN): one reading pass, no tensor of flags as large as the parameter to allocate."""
    if not named:
        return []
    with torch.no_grad():
        # in each tensor's own dtype: fp64's largest finite value is inf as fp32
        finite = torch.stack(
            [torch.isfinite(torch.stack(torch.aminmax(p))).all() for _, p in named]
        )
        finite = finite.tolist()  # [n]
    return [n for (n, _), ok in zip(named, finite) if not ok]


_NUMPY_DTYPES = {
    torch.uint8: np.uint8,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The memory of the contiguous CPU tensor ``t`` (a dtype numpy has) as a 1-d numpy array,
    valid while ``t``'s storage keeps it. Not ``Tensor.numpy()``, which makes the storage not
    resizable for good: ZeRO-3 releases its whole parameters by resizing theirs to 0."""
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return np.frombuffer(raw, dtype=_NUMPY_DTYPES[t.dtype])


def non_finite_beside_training(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """``non_finite``, for a thread that runs beside the training step (the async writer): on
    CPU each tensor's minimum and maximum come from numpy, whose reductions run on the calling
    thread alone and release the GIL, so the step keeps its cores and its Python runs between
    them. Other tensors (a device, a dtype numpy lacks: bf16) take ``non_finite``'s ops."""
    bad, rest = set(), []  # indices into ``named``: its names may repeat (model chunks)
    for i, (_, p) in enumerate(named):
        if p.device.type == "cpu" and p.dtype in _NUMPY_DTYPES and p.is_contiguous():
            values = numpy_view(p)  # the minimum and maximum of values with a NaN are NaN
            if not (np.isfinite(values.min()) and np.isfinite(values.max())):
                bad.add(i)
        else:
            rest.append((i, p))
    found = non_finite([(str(i), p) for i, p in rest])
    bad.update(int(i) for i in found)
    return [name for i, (name, _) in enumerate(named) if i in bad]


def _latest(save_dir: str) -> str:
    try:
        latest = read_tracker(save_dir)
    except CheckpointError:
        latest = None
    return "none yet" if latest is None else f"iteration {latest}"


def _refusal(save_dir: str, iteration: int, names: list[str]) -> CheckpointError:
    """A checkpoint whose parameters are not finite never becomes the latest."""
    where = f"{len(names)} on this rank, e.g. {names[0]}" if names else "on another rank"
    return CheckpointError(
        f"iteration {iteration}: refusing to save a checkpoint to {save_dir} whose parameters are "
        f"not finite (NaN/inf: {where}); the latest checkpoint stays {_latest(save_dir)}; the run "
        "diverged: resume from it with a lower --lr (fp16: a lower --initial-loss-scale, or --bf16)"
    )


def _stop_on_failure(
    failure: CheckpointError | None, save_dir: str, iteration: int, ps: ParallelState
) -> None:
    """Collective (``ps.group()``): if any rank failed to write its part of the checkpoint, every
    rank raises a CheckpointError, rank 0 having removed the partial ``iter_*`` folder; the
    tracker still names the previous checkpoint. Training stops (as Megatron's does)."""
    if not world_sum(0.0 if failure is None else 1.0, ps):
        return
    iter_dir = iteration_dir(save_dir, iteration)
    if ps.rank() == 0 and read_tracker(save_dir) != iteration:
        shutil.rmtree(iter_dir, ignore_errors=True)
    cause = str(failure) if failure is not None else "a write failed on another rank"
    raise CheckpointError(
        f"saving the checkpoint of iteration {iteration} to {save_dir} failed: {cause}; its "
        f"partial files are removed and the latest checkpoint stays {_latest(save_dir)}; "
        "training stops: free space or pick another --save, then resume with --load"
    )


@dataclasses.dataclass
class PendingSave:
    """One rank's part of a checkpoint, ready to write: what ``prepare_save`` gathered (every
    collective of a save but the commit is done) and ``write_pending`` writes without one.
    ``unchecked``: the live parameters still to check for NaN/inf (``prepare_save``'s
    ``defer_finite_check``; empty when checked already)."""

    save_dir: str
    iteration: int
    iter_dir: str
    folder: str  # this rank's mp_rank_* folder (named in a write failure)
    writes: list[tuple[str, object]]  # (path, object for torch.save), in order
    keep_last_n: int | None
    started: float  # time.perf_counter() when the save began
    ps: ParallelState
    unchecked: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)


def save_checkpoint(save_dir: str, iteration: int, **pieces) -> str:
    """Write the checkpoint of ``iteration`` under ``save_dir``; returns its directory. The
    arguments are ``prepare_save``'s: ``prepare_save``, ``write_pending`` and
    ``commit_checkpoint`` in a row. Collective over the world (module docstring)."""
    pending = prepare_save(save_dir, iteration, **pieces)
    written, failure = write_pending(pending)
    return finish_save(pending, written=written, failure=failure)


def finish_save(
    pending: PendingSave,
    *,
    written: int,
    failure: CheckpointError | None,
    non_finite_names: list[str] | None = None,
) -> str:
    """``commit_checkpoint`` of a written ``pending`` save and its log line; returns its
    directory. Collective over the world. ``non_finite_names``: with a deferred check
    (``pending.unchecked``), the names it found on this rank (``[]`` none; a rank that found
    some wrote no file): if any rank found one, every rank raises the refusal a synchronous save
    raises and rank 0 removes the iteration's folder, so no file of it stays."""
    if non_finite_names is not None:
        p = pending
        _refuse_non_finite(p.save_dir, p.iteration, p.ps, non_finite_names, remove_files=True)
    total = commit_checkpoint(
        pending.save_dir,
        pending.iteration,
        ps=pending.ps,
        written=written,
        failure=failure,
        keep_last_n=pending.keep_last_n,
    )
    seconds = time.perf_counter() - pending.started
    megabytes = total / 1e6
    logger.info(
        "saved checkpoint at iteration %d to %s in %.2f s (%.1f MB, %.1f MB/s)",
        pending.iteration,
        pending.save_dir,
        seconds,
        megabytes,
        megabytes / max(seconds, 1e-9),
    )
    return pending.iter_dir


def _refuse_non_finite(
    save_dir: str, iteration: int, ps: ParallelState, names: list[str], *, remove_files: bool
) -> None:
    """Collective (``ps.group()``; also a barrier): raise the refusal on every rank when any rank
    found a non-finite parameter (``names``: this rank's); ``remove_files``: rank 0 first removes
    the iteration's folder (other ranks' files of it; the tracker never named it)."""
    if not world_sum(float(len(names)), ps):
        return
    if remove_files and ps.rank() == 0 and read_tracker(save_dir) != iteration:
        shutil.rmtree(iteration_dir(save_dir, iteration), ignore_errors=True)
    raise _refusal(save_dir, iteration, names)


def prepare_save(
    save_dir: str,
    iteration: int,
    *,
    model_chunks: list[nn.Module],
    optimizer,
    scheduler,
    ps: ParallelState,
    rng_tracker,
    device: torch.device,
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    config_record: dict | None = None,
    save_optim: bool = True,
    keep_last_n: int | None = None,
    defer_finite_check: bool = False,
) -> PendingSave:
    """Gather this rank's part of the checkpoint of ``iteration`` (every collective of the save
    but the commit: the non-finite check, the RNG states over DP, a sharded optimizer's experts)
    without writing a file. Its tensors are views of the live state: write it (``write_pending``)
    before the next step, or write a host copy of it (``async_save``).

    ``model_chunks``: this rank's GPT chunk modules, chunk 0 first (not the data-parallel
    wrappers); several (virtual stages, V schedules) are written as ``model0``, ``model1``, ...
    with the layout of every global stage, and gathered over ``ps.group("pp")``.
    ``optimizer``: the plain or the sharded mixed-precision optimizer; ``scheduler``: anything
    with ``state_dict()``. ``rng_tracker``: the TP RNG tracker or None. ``config_record``: the run's
    settings as plain data, recorded as ``header["config"]`` (its ``"model"`` entry defaults to
    the stage's GPTConfig). ``save_optim=False`` (``--no-save-optim``) writes the model, RNG and
    counters only; ``keep_last_n`` (``--keep-last-n-checkpoints``) then deletes older iterations
    at the commit. ``defer_finite_check``: the parameters are not checked for NaN/inf here but
    listed in ``pending.unchecked``, for whoever copies them (``async_save``) to check before the
    optimizer changes them and to pass to ``finish_save``. Collective over the world (module
    docstring)."""
    if not save_dir:
        raise CheckpointError("save_checkpoint needs a directory: pass --save DIR")
    chunks = check_chunks(model_chunks)
    module = chunks[0]
    iteration = int(iteration)
    started = time.perf_counter()
    iter_dir = iteration_dir(save_dir, iteration)
    if ps.rank() == 0 and os.path.isdir(iter_dir) and read_tracker(save_dir) != iteration:
        shutil.rmtree(iter_dir)  # an uncommitted save of this iteration (a crash): start clean
    table = stage_table(chunks, ps) if len(chunks) > 1 else None
    checked = checked_parameters(chunks)
    if defer_finite_check:
        world_sum(0.0, ps)  # the barrier after the clean-up above
    else:  # also the barrier after the clean-up above
        _refuse_non_finite(save_dir, iteration, ps, non_finite(checked), remove_files=False)
    folder = shard_dir(iter_dir, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, pp_size=ps.pp_size)
    dp_rank = ps.rank("dp", "cp")
    writes: list[tuple[str, object]] = []
    if save_optim and optimizer.is_sharded:
        writes.append(
            (os.path.join(folder, distrib_optim_file(dp_rank)), optimizer.sharded_state_dict())
        )
    own = optimizer.dp_rank_state() if save_optim else None  # state that differs per DP rank
    if own is not None:
        writes.append((os.path.join(folder, dp_rank_optim_file(dp_rank)), own))
    rng = gather_over_dp(capture_rng_state(rng_tracker, device), ps)
    if dp_rank == 0:
        if not save_optim:
            optim_state = None
        elif optimizer.is_sharded:
            optim_state = {"distributed": True}
        else:
            optim_state = optimizer_full_state(optimizer)
        record = {"model": plain_data(dataclasses.asdict(module.config)), **(config_record or {})}
        header = shard_header(
            iteration=iteration,
            consumed_train_samples=consumed_train_samples,
            consumed_valid_samples=consumed_valid_samples,
            config=record,
            layout=_layout(chunks, optimizer, ps, table),
            model=module.state_dict() if len(chunks) == 1 else None,
            optimizer=optim_state,
            scheduler=scheduler.state_dict() if save_optim else None,
            rng_state=rng,
        )
        if len(chunks) > 1:  # Megatron's keys, each chunk's layers numbered from 0
            header.update({f"model{c}": m.state_dict() for c, m in enumerate(chunks)})
        writes.append((os.path.join(folder, MODEL_FILE), header))
    expert_optim = gather_expert_optimizer(module, optimizer if save_optim else None, ps)
    # MoE experts in files of their own, by global expert index
    experts = expert_file(iter_dir, module, optimizer if save_optim else None, ps, expert_optim)
    if experts is not None:
        writes.append(experts)
    unchecked = checked if defer_finite_check else []
    return PendingSave(
        save_dir, iteration, iter_dir, folder, writes, keep_last_n, started, ps, unchecked
    )


def write_pending(pending: PendingSave) -> tuple[int, CheckpointError | None]:
    """Write and fsync this rank's files of ``pending`` (crash-safe, ``files.save_file``), then
    their folders; no collective, so a background thread may run it. Returns (bytes written,
    this rank's CheckpointError or None): a failure is reported, not raised, because every rank
    still joins the commit."""
    written = 0
    folders: list[str] = []
    try:
        for path, obj in pending.writes:
            folder = os.path.dirname(path)
            if folder not in folders:
                os.makedirs(folder, exist_ok=True)
                folders.append(folder)
            written += save_file(obj, path)
        for folder in [*folders, pending.iter_dir] if folders else []:
            fsync_dir(folder)
    except OSError as e:
        return written, write_failure(pending.folder, e)
    except CheckpointError as e:
        return written, e
    return written, None


def commit_checkpoint(
    save_dir: str,
    iteration: int,
    *,
    ps: ParallelState,
    written: int,
    failure: CheckpointError | None,
    keep_last_n: int | None = None,
) -> float:
    """The second half of ``save_checkpoint``, once this rank's files of ``iteration`` are written
    and fsynced (``written`` bytes; ``failure``: this rank's error, or None). Collective over
    ``ps.group()``: every rank learns that every rank's files are complete, then rank 0 replaces
    the tracker (and deletes the iterations ``keep_last_n`` lets go). Returns the bytes all ranks
    wrote. A failure on any rank raises a CheckpointError on every rank, the partial iteration
    removed. Until rank 0 has replaced the tracker, a crash leaves the previous checkpoint the
    latest (the crash tests stop a save on entry here)."""
    _stop_on_failure(failure, save_dir, iteration, ps)  # the files of every rank, or none
    total = world_sum(written, ps)  # every rank has written and fsynced its files
    if ps.rank() == 0:
        try:
            write_tracker(save_dir, iteration)
        except CheckpointError as e:
            failure = e
        if keep_last_n and failure is None:
            remove_old_checkpoints(save_dir, keep=keep_last_n, latest=iteration)
    # the tracker names this checkpoint on return, on every rank
    _stop_on_failure(failure, save_dir, iteration, ps)
    return total
