"""Find out how this process was launched and join the process group.

Three ways, detected from the environment in this order:

- **torchrun** (or any launcher that sets them): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``.
- **srun without torchrun**: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the master is
  the first host of ``SLURM_NODELIST`` (``scontrol show hostnames``, or our own parse of the compact
  form when scontrol is absent), the port ``MASTER_PORT`` or 29500.
- **one plain process**: none of the above; a world of one.

The backend is gloo on CPU and nccl on CUDA.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.core.parallel_state import default_backend, init_single_process
from megalite.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "torchrun", "srun" or "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list: ``"gpu[01-03,07],cpu5"`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Handles zero-padded ranges and several bracket groups in one name (``a[1-2]b[3-4]``).
    """
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]+|\[[^\]]*\])+", nodelist):
        expanded = [""]
        for literal, brackets in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [literal]
            if brackets:
                choices = []
                for part in brackets.split(","):
                    if "-" in part:
                        lo, hi = part.split("-", 1)
                        width = len(lo)
                        choices += [f"{literal}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(literal + part)
            expanded = [prefix + c for prefix in expanded for c in choices]
        hosts += [h for h in expanded if h]
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """The first host of ``nodelist``, from ``scontrol show hostnames`` when available."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"SLURM_NODELIST={nodelist!r} names no host")
    return hosts[0]


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's environment (``os.environ`` by default); see the module docstring."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(
            "torchrun",
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        addr = env.get("MASTER_ADDR")
        if addr is None and world > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError("srun launch: SLURM_NODELIST is not set; set MASTER_ADDR")
            addr = first_slurm_host(nodelist)
        return LaunchInfo(
            "srun",
            rank=_int(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT,
        )
    return LaunchInfo("single", 0, 1, 0, None, None)


def select_device(kind: str, local_rank: int) -> torch.device:
    """``kind``: "cpu", "cuda" or "auto" (CUDA when available). On CUDA, device ``local_rank``."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def attempt_store(launch: LaunchInfo, env: Mapping[str, str], timeout: timedelta):
    """The rendezvous store of this attempt when torchrun shares its agent's store, else None.

    torchrun's c10d rendezvous keeps one store server for the whole job and hands it to every
    attempt, but ``env://`` does not separate the attempts' keys. After a restart, a rank can then
    read a peer's gloo address from the dead attempt and fail with ``connectFullMesh ... Connection
    refused``. Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` gives each attempt its own.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if launch.master_addr is None or launch.master_port is None:
        raise ValueError("torchrun launch: MASTER_ADDR and MASTER_PORT must be set")
    store = dist.TCPStore(
        launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"megalite/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(
    launch: LaunchInfo, device: torch.device, *, timeout_minutes: float = 10.0
) -> None:
    """Join (or create) the default process group for ``launch`` with the device's backend."""
    if dist.is_initialized():
        return
    backend = default_backend(device)
    timeout = timedelta(minutes=timeout_minutes)
    if launch.launcher == "single":
        init_single_process(device)
        return
    if launch.launcher == "torchrun":
        store = attempt_store(launch, os.environ, timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                store=store,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
        return
    addr = launch.master_addr or "127.0.0.1"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    except RuntimeError as e:  # DistNetworkError: the rendezvous port cannot be bound
        text = str(e)
        if "EADDRINUSE" not in text and "address already in use" not in text.lower():
            raise
        raise UserError(
            f"srun launch: MASTER_PORT {launch.master_port} on {addr} is in use (another job or "
            "process listens there); export MASTER_PORT=<a free port>, e.g. "
            "$((20000 + SLURM_JOB_ID % 20000)), in the sbatch script"
        ) from None
    logger.info("srun launch: %d tasks, master %s:%s", launch.world_size, addr, launch.master_port)
