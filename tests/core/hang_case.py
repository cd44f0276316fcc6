"""One rank of a job that hangs on purpose, for ``test_hang_watchdog.py``.

    python -m tests.core.hang_case FAULT RANK WORLD_SIZE INIT_FILE TIMEOUT_S

Joins a gloo world through ``file://INIT_FILE``, turns the op recorder and the hang watchdog on
(timeout ``TIMEOUT_S`` seconds) and runs one 1F1B step of a tiny two-stage pipeline (``pp``
faults) or one data-parallel step over two ranks (``bucket``), with ``FAULT`` injected:
- ``skip_send``: pipeline rank 0 leaves micro-batch 1's activation unsent;
- ``sleep_forward``: pipeline rank 1 sleeps past the timeout in the forward of micro-batch 2;
- ``die``: rank 1 exits (code 3) in the forward of micro-batch 2;
- ``bucket``: rank 1 holds one more parameter, so one more grad bucket than rank 0: it waits in
  that bucket's all-reduce while rank 0 has gone on to the next collective (a loss all-reduce
  over the world group);
- ``none``: nothing (the run must finish and exit 0).
The watchdog prints the report and exits 1; a run that finishes prints "finished".
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.groups import all_reduce_tensor
from megalite.core.hang_watchdog import HangWatchdog
from megalite.core.op_record import RECORDER
from megalite.core.pipeline_parallel.actions import P2PBatch
from megalite.core.pipeline_parallel.executor import execute
from megalite.core.pipeline_parallel.forward_backward import _programs
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from tests.mesh import mesh

S, B, H, M = 4, 2, 8, 4


class Stage(nn.Module):
    def __init__(self, first: bool):
        super().__init__()
        self.first, self.input_tensor = first, None
        self.lin1, self.lin2 = nn.Linear(H, H), nn.Linear(H, H)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x if self.first else self.input_tensor)))


def _forward_step(fault: str, rank: int):
    calls = [0]

    def step(data_iterator, model):
        mb = calls[0]
        calls[0] += 1
        if rank == 1 and mb == 2 and fault == "sleep_forward":
            time.sleep(3600)
        if rank == 1 and mb == 2 and fault == "die":
            os._exit(3)
        out = model(next(data_iterator))
        return out, lambda o: ((o * o).mean(), {"loss": (o * o).mean().detach()})

    return step


def _without_send(program, microbatch: int):
    """``program`` with the SEND_F of ``microbatch`` taken out of its batch."""
    out = []
    for item in program:
        if isinstance(item, P2PBatch):
            kept = tuple(
                a for a in item.actions if not (a.op == "SEND_F" and a.microbatch == microbatch)
            )
            if kept:
                out.append(P2PBatch(item.tick, kept))
        else:
            out.append(item)
    return out


def pipeline_step(fault: str, rank: int) -> None:
    ps = mesh(1, 2)
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=(S, B, H),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
    )
    torch.manual_seed(0)
    data = [torch.randn(S, B, H) for _ in range(M)]
    program = _programs("1f1b", 2, M, 1, None, False)[ps.pp_rank]
    if fault == "skip_send" and ps.pp_rank == 0:
        program = _without_send(program, 1)
    execute(
        program,
        layout=layout_of("1f1b", 2, 1),
        pp_rank=ps.pp_rank,
        forward_step_func=_forward_step(fault, rank),
        model=[ModelChunk(Stage(ps.pp_rank == 0))],
        data_iterator=[iter(data)],
        num_microbatches=M,
        p2p=p2p,
    )


def bucket_step(fault: str, rank: int) -> None:
    ps = mesh(1, 1)
    torch.manual_seed(0)
    stage = Stage(True)
    if fault == "bucket" and rank == 1:  # one more bucket than rank 0 (the same size: gloo
        # aborts the process on a size mismatch rather than hang)
        stage.extra = nn.Parameter(torch.zeros(H * H + H))
    ddp = DistributedDataParallel(
        stage, dp_group=ps.dp_group, bucket_size=H * H + H, overlap_grad_reduce=True
    )
    ddp.zero_grad_buffer()
    p2p = P2PCommunicator(
        prev_rank=None,
        next_rank=None,
        tensor_shape=(S, B, H),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
    )
    data = [torch.randn(S, B, H) for _ in range(M)]
    losses = execute(
        _programs("1f1b", 1, M, 1, None, False)[0],
        layout=layout_of("1f1b", 1, 1),
        pp_rank=0,
        forward_step_func=_forward_step(fault, rank),
        model=[ModelChunk(stage, grad_wrapper=ddp)],
        data_iterator=[iter(data)],
        num_microbatches=M,
        p2p=p2p,
    )
    ddp.finish_grad_sync()
    loss = torch.stack([d["loss"] for d in losses]).sum().reshape(1)
    all_reduce_tensor(loss, dist.group.WORLD, what="loss")  # a group of its own


def main(fault: str, rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),  # the watchdog's timeout comes first
    )
    RECORDER.enable(rank=rank)
    watchdog = HangWatchdog(
        RECORDER,
        timeout_s=timeout_s,
        store=dist.distributed_c10d._get_default_store(),
        rank=rank,
        world_size=world_size,
        grace_s=4.0,
    )
    watchdog.start()
    print(f"watching from {time.time():.3f}", flush=True)  # the test's clock starts here
    with watchdog.guard():
        (bucket_step if fault == "bucket" else pipeline_step)(fault, rank)
    watchdog.stop()
    print("finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    fault, rank, world_size, init_file, timeout_s = sys.argv[1:6]
    main(fault, int(rank), int(world_size), init_file, float(timeout_s))
