"""One rank of one attempt of a job whose launcher shares its rendezvous store between attempts
(as torchrun's c10d rendezvous does): joins the world with ``init_distributed``, all-reduces its
rank + 1 and prints the sum. The first attempt then waits to be killed (torchrun kills a failed
attempt's ranks); in the second, the rank named by ``SLOW_RANK`` joins 2 s late, which leaves its
peer time to read a stale address if the attempts' keys are not kept apart."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from megalite.training.launch import detect_launch, init_distributed

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt != "0" and os.environ["RANK"] == os.environ["SLOW_RANK"]:
    time.sleep(2)
init_distributed(detect_launch(), torch.device("cpu"), timeout_minutes=1.0)
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {dist.get_rank()} sum {total.item():.0f}", flush=True)
if attempt == "0":
    time.sleep(600)
dist.destroy_process_group()
