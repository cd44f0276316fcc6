"""The op recorder and hang watchdog of a training run (``core/op_record.py``,
``core/hang_watchdog.py``), on with ``ParallelConfig.hang_watchdog``: ``--hang-watchdog``, or
``--distributed-timeout-minutes`` given on the command line (its value is the timeout).

    watch = start_hang_watch(cfg.parallel, ps)     # None when off
    try:
        train()
    except Exception as exc:
        if watch is not None:
            watch.on_error(exc)                      # a collective failed: explain, end the job
        raise
    finally:
        stop_hang_watch(watch)
"""

from __future__ import annotations

import torch.distributed as dist

from megalite.core.hang_watchdog import HangWatchdog
from megalite.core.op_record import RECORDER
from megalite.core.parallel_state import ParallelState
from megalite.training.parallel_config import ParallelConfig


def start_hang_watch(parallel: ParallelConfig, ps: ParallelState) -> HangWatchdog | None:
    """Turn the recorder on and start this rank's watchdog; None when the config has it off or
    there is no process group (a run of one process has nobody to wait for)."""
    if not parallel.hang_watchdog or not dist.is_initialized():
        return None
    RECORDER.enable(rank=ps.rank())
    RECORDER.coords.update(pp=ps.pp_rank, dp=ps.dp_rank, tp=ps.tp_rank)
    watch = HangWatchdog(
        RECORDER,
        timeout_s=parallel.distributed_timeout_minutes * 60.0,
        store=dist.distributed_c10d._get_default_store(),
        rank=ps.rank(),
        world_size=ps.world_size,
    )
    watch.start()
    return watch


def stop_hang_watch(watch: HangWatchdog | None) -> None:
    if watch is not None:
        watch.stop()
        RECORDER.disable()
