"""The process-group mesh: tensor-, pipeline- and data-parallel groups over one world.

Ranks are laid out with TP fastest, then DP, then PP::

    rank = pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank

so a TP group is ``tp_size`` consecutive ranks (one node in practice, its traffic on NVLink) and PP
is
the slowest axis (it crosses nodes). ``initialize_model_parallel`` builds every group once and
returns
a ``ParallelState``; core modules take the group they communicate over as an argument, never a
global.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def coords_to_rank(tp_rank: int, dp_rank: int, pp_rank: int, *, tp_size: int, dp_size: int) -> int:
    return pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank


def rank_to_coords(rank: int, *, tp_size: int, dp_size: int) -> tuple[int, int, int]:
    """The (tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp_size, (rank // tp_size) % dp_size, rank // (tp_size * dp_size)


def validate_parallel_sizes(world_size: int, tp_size: int, pp_size: int) -> int:
    """Check the mesh factors the world and return dp_size; one-line ValueError otherwise."""
    for flag, value in (
        ("--tensor-model-parallel-size", tp_size),
        ("--pipeline-model-parallel-size", pp_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if world_size % (tp_size * pp_size) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp_size} "
            f"x --pipeline-model-parallel-size {pp_size} = {tp_size * pp_size}; launch a multiple "
            f"of {tp_size * pp_size} processes or change the sizes"
        )
    return world_size // (tp_size * pp_size)


def mesh_group_ranks(world_size: int, tp_size: int, pp_size: int) -> dict[str, list[list[int]]]:
    """Every group of every axis as lists of global ranks, in a fixed order (pure; no collectives).

    Keys: ``tp``, ``dp``, ``pp``, ``mp`` (TP x PP: all ranks holding one model replica) and
    ``embedding`` (first and last PP stage of each (tp, dp) coordinate; one rank when pp_size == 1).
    """
    dp_size = validate_parallel_sizes(world_size, tp_size, pp_size)

    def rank(t: int, d: int, p: int) -> int:
        return coords_to_rank(t, d, p, tp_size=tp_size, dp_size=dp_size)

    tp = [[rank(t, d, p) for t in range(tp_size)] for p in range(pp_size) for d in range(dp_size)]
    dp = [[rank(t, d, p) for d in range(dp_size)] for p in range(pp_size) for t in range(tp_size)]
    pp = [[rank(t, d, p) for p in range(pp_size)] for d in range(dp_size) for t in range(tp_size)]
    mp = [[rank(t, d, p) for p in range(pp_size) for t in range(tp_size)] for d in range(dp_size)]
    embedding = [sorted({g[0], g[-1]}) for g in pp]
    return {"tp": tp, "dp": dp, "pp": pp, "mp": mp, "embedding": embedding}


@dataclass
class ParallelState:
    """Sizes, ranks and groups of this process in the TP x DP x PP mesh.

    Groups are ``torch.distributed`` process groups (or None when ``world_size == 1`` and no process
    group was initialised; every collective in megalite returns at once on a group of one).
    """

    world_size: int
    global_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object
    embedding_group: object  # None on middle pipeline stages, which hold no embedding
    pp_ranks: list[int]  # global ranks of this rank's pipeline, stage order
    embedding_ranks: list[int]
    device: torch.device
    backend: str
    world_group: object = None  # every rank, always passed explicitly (None in a world of one)

    # Named axes (issue 12, in progress): cp = ep = 1 for now, so ("dp", "cp") is the DP group.
    def group(self, *axes: str) -> object:
        """The process group over ``axes`` holding this rank; no axes: the world group."""
        return self._axes_entry(axes)[0]

    def size(self, *axes: str) -> int:
        """Ranks in ``group(*axes)``; no axes: the world size."""
        return self._axes_entry(axes)[1]

    def rank(self, *axes: str) -> int:
        """This rank's index in ``group(*axes)``; no axes: the global rank."""
        return self._axes_entry(axes)[2]

    def _axes_entry(self, axes: tuple[str, ...]) -> tuple[object, int, int]:
        key = frozenset(a for a in axes if a not in ("cp", "ep"))
        table = {
            frozenset(): (self.world_group, self.world_size, self.global_rank),
            frozenset({"tp"}): (self.tp_group, self.tp_size, self.tp_rank),
            frozenset({"dp"}): (self.dp_group, self.dp_size, self.dp_rank),
            frozenset({"pp"}): (self.pp_group, self.pp_size, self.pp_rank),
        }
        if key not in table:
            raise ValueError(f"no process group for axes {axes}")
        return table[key]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.global_rank in self.embedding_ranks

    @classmethod
    def single(cls, device: torch.device | None = None) -> ParallelState:
        """A mesh of one whose groups are None (no communication): for single-process oracles,
        also inside a multi-rank test."""
        device = device or torch.device("cpu")
        return cls(
            world_size=1, global_rank=0, tp_size=1, pp_size=1, dp_size=1, tp_rank=0, pp_rank=0,
            dp_rank=0, tp_group=None, pp_group=None, dp_group=None, mp_group=None,
            embedding_group=None, pp_ranks=[0], embedding_ranks=[0], device=device,
            backend=default_backend(device),
        )  # fmt: skip

    def destroy(self) -> None:
        """Destroy the groups this state created (the world group stays)."""
        seen = set()
        for g in (self.tp_group, self.pp_group, self.dp_group, self.mp_group, self.embedding_group):
            if g is not None and id(g) not in seen and g is not dist.group.WORLD:
                seen.add(id(g))
                dist.destroy_process_group(g)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_single_process(device: torch.device | None = None) -> None:
    """Initialise a world of one (file rendezvous, no port): a plain process runs the same code."""
    device = device or torch.device("cpu")
    path = os.path.join(tempfile.mkdtemp(prefix="megalite-"), "rendezvous")
    dist.init_process_group(
        default_backend(device), init_method=f"file://{path}", rank=0, world_size=1
    )


def _new_groups(
    ranks_list: list[list[int]], rank: int, backend: str, timeout: timedelta | None
) -> object:
    """Create every group of one axis (a collective over the world); return this rank's."""
    mine = None
    for ranks in ranks_list:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    device: torch.device | None = None,
    timeout: timedelta | None = None,
) -> ParallelState:
    """Build the TP, PP, DP, model-parallel and embedding groups on an initialised world.

    If no process group is initialised, a world of one is created (plain single-process run). All
    ranks must call this with the same sizes; groups are created in the same order everywhere.
    """
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise RuntimeError(
                f"WORLD_SIZE={world} but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (or launch with torchrun)"
            )
        init_single_process(device)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp_size, pp_size = tensor_model_parallel_size, pipeline_model_parallel_size
    ranks = mesh_group_ranks(world_size, tp_size, pp_size)
    dp_size = world_size // (tp_size * pp_size)
    device = device or torch.device("cpu")
    backend = dist.get_backend()
    groups = {axis: _new_groups(ranks[axis], rank, backend, timeout) for axis in ranks}
    tp_rank, dp_rank, pp_rank = rank_to_coords(rank, tp_size=tp_size, dp_size=dp_size)
    pp_ranks = next(g for g in ranks["pp"] if rank in g)
    # the first and last stage of this rank's pipeline (middle stages are not members)
    embedding_ranks = sorted({pp_ranks[0], pp_ranks[-1]})
    return ParallelState(
        world_size=world_size,
        global_rank=rank,
        world_group=dist.group.WORLD if world_size > 1 else None,
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=dp_size,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_group=groups["tp"],
        pp_group=groups["pp"],
        dp_group=groups["dp"],
        mp_group=groups["mp"],
        embedding_group=groups["embedding"],
        pp_ranks=pp_ranks,
        embedding_ranks=embedding_ranks,
        device=device,
        backend=backend,
    )
