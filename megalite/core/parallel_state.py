"""The process-group mesh: named axes over one world, and the groups each rank communicates over.

    ps = initialize_model_parallel(2, 2, context_parallel_size=1, device=device)
    ps.group("tp"), ps.size("dp", "cp"), ps.rank("pp")      # any combination built here
    ps.group()                                              # the world, always passed explicitly

The layout (which ranks form a group) is ``megalite.core.mesh_layout``: axes ``tp, cp, ep, dp, pp``,
Megatron's order ``tp-cp-ep-dp-pp`` by default (TP fastest)::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))          (dense view, EP = 1)

and an expert view ``etp x ep x edp x pp`` of the same world that shares the pipeline groups.
Under a 2d or 2.5d tensor-parallel mode the tensor group is also a grid with sub-axes ``tp_col``,
``tp_row``, ``tp_depth`` (``mesh_layout.tp_grid_groups``): ``ps.group("tp_row")`` and so on;
under 3d a cube with sub-axes ``tp_input``, ``tp_weight``, ``tp_output``.
``initialize_model_parallel`` creates every group once (a collective over the world, in the same
order on every rank) and returns a ``ParallelState``; core modules take the group they communicate
over as an argument, never a global, and never the implicit world group.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# imported here, before any world exists: torch.distributed.nn's functions take
# ``group=group.WORLD`` as a default, evaluated at import, and torch imports the module lazily
# (the first optimizer imports torch._dynamo, which imports it); imported inside a world, those
# defaults hold the world group for the life of the process, and with it the group's gloo worker
# threads, which then run into interpreter shutdown (see ``pretrain``)
import torch.distributed.nn  # noqa: F401

from megalite.core.mesh_layout import (
    DEFAULT_ORDER,
    GRID3D_AXES,
    TP_GRID_AXES,
    MeshSizes,
    dense_or_expert,
    mesh_sizes,
    rank_groups,
    tp_grid_groups,
)

# The axis combinations built at start-up (new_group is a collective, so groups cannot be made on
# demand). Dense: grad sync over ("dp", "cp"), the grad norm over ("tp", "pp"), ... Expert: the
# expert-parallel groups of MoE layers. Identical partitions share one process group.
DENSE_GROUPS = (
    ("tp",),
    ("cp",),
    ("dp",),
    ("pp",),
    ("tp", "cp"),
    ("dp", "cp"),
    ("tp", "pp"),
    ("tp", "dp", "cp"),
)
EXPERT_GROUPS = (("etp",), ("ep",), ("edp",), ("etp", "ep"), ("etp", "ep", "pp"))
# the sub-axes of a 2d / 2.5d / 3d tensor group (built only under those modes; groups of one in
# single())
GRID_GROUPS = (("tp_col",), ("tp_row",), ("tp_depth",), ("tp_row", "tp_depth")) + tuple(
    (a,) for a in GRID3D_AXES
)


class ParallelState:
    """Sizes, ranks and groups of this process in the mesh; see the module docstring.

    ``group(*axes)`` / ``size(*axes)`` / ``rank(*axes)``: the group over a combination of axes
    (order of the arguments does not matter), its size, and this rank's index in it; no axes =
    the world. Groups are ``torch.distributed`` process groups, or None in ``single()`` (every
    collective in megalite returns at once on a group of one). The shorthands ``tp_group``,
    ``dp_size``, ``pp_rank``, ... are ``group("tp")``, ``size("dp")``, ``rank("pp")``, ...
    """

    def __init__(
        self,
        *,
        sizes: MeshSizes,
        global_rank: int,
        groups: dict[frozenset, tuple[object, list[int]]],
        embedding: tuple[object, list[int]],
        device: torch.device,
        backend: str,
        world_group: object,
    ):
        self.sizes, self.global_rank = sizes, global_rank
        self.world_size, self.order = sizes.world_size, sizes.order
        self._groups = groups  # frozenset(axes) -> (process group, its ranks in group order)
        self.embedding_group, self.embedding_ranks = embedding  # group None on middle stages
        self.device, self.backend, self.world_group = device, backend, world_group

    # --- any combination of axes ----------------------------------------------------------------

    def _entry(self, axes: tuple[str, ...]) -> tuple[object, list[int]]:
        if not axes:
            return self.world_group, list(range(self.world_size))
        key = frozenset(axes)
        if key not in self._groups:
            built = sorted("(" + ", ".join(sorted(k)) + ")" for k in self._groups)
            raise ValueError(f"no process group over axes {tuple(axes)}; built: {', '.join(built)}")
        return self._groups[key]

    def group(self, *axes: str) -> object:
        """The process group over ``axes`` that holds this rank; no axes: the world group."""
        return self._entry(axes)[0]

    def size(self, *axes: str) -> int:
        """Ranks in ``group(*axes)``; no axes: the world size."""
        return len(self._entry(axes)[1])

    def rank(self, *axes: str) -> int:
        """This rank's index in ``group(*axes)``; no axes: the global rank."""
        return self._entry(axes)[1].index(self.global_rank)

    def ranks(self, *axes: str) -> list[int]:
        """The global ranks of ``group(*axes)``, in group order."""
        return list(self._entry(axes)[1])

    # --- shorthands (the names the rest of megalite reads) ----------------------------------------

    tp_size = property(lambda self: self.size("tp"))
    cp_size = property(lambda self: self.size("cp"))
    dp_size = property(lambda self: self.size("dp"))
    pp_size = property(lambda self: self.size("pp"))
    tp_rank = property(lambda self: self.rank("tp"))
    cp_rank = property(lambda self: self.rank("cp"))
    dp_rank = property(lambda self: self.rank("dp"))
    pp_rank = property(lambda self: self.rank("pp"))
    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))
    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    mp_group = property(lambda self: self.group("tp", "pp"))  # one model replica's ranks
    pp_ranks = property(lambda self: self.ranks("pp"))  # this rank's pipeline, stage order

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

    def __repr__(self) -> str:
        s = self.sizes
        return (
            f"ParallelState(rank {self.global_rank} of {self.world_size}: tp {s.tp} cp {s.cp} "
            f"dp {s.dp} pp {s.pp} | etp {s.etp} ep {s.ep} edp {s.edp}, order {s.order}"
            f"{self._grid_text()})"
        )

    def _grid_text(self) -> str:
        """``, tp mode 2.5d (depth 2 x row 2 x col 2)`` under a grid mode; empty under 1d."""
        s = self.sizes
        if s.tp_mode == "1d":
            return ""
        shown_order = ("tp_depth", "tp_row", "tp_col", *reversed(GRID3D_AXES))  # slowest first
        axes = [a for a in shown_order if a in TP_GRID_AXES[s.tp_mode]]
        shown = " x ".join(f"{a[3:]} {self.size(a)}" for a in axes)
        return f", tp mode {s.tp_mode} ({shown})"

    @classmethod
    def single(cls, device: torch.device | None = None) -> ParallelState:
        """A mesh of one whose groups are None (no communication): for single-process oracles,
        also inside a multi-rank test."""
        device = device or torch.device("cpu")
        keys = [frozenset(a) for a in DENSE_GROUPS + EXPERT_GROUPS + GRID_GROUPS]
        return cls(
            sizes=MeshSizes(1),
            global_rank=0,
            groups={k: (None, [0]) for k in keys},
            embedding=(None, [0]),
            device=device,
            backend=default_backend(device),
            world_group=None,
        )

    def destroy(self) -> None:
        """Destroy the groups this state created (the world group stays)."""
        seen = set()
        for g in [g for g, _ in self._groups.values()] + [self.embedding_group]:
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


def all_group_ranks(sizes: MeshSizes) -> dict[frozenset, list[list[int]]]:
    """Every built axis combination -> its groups (pure; the plan ``initialize_model_parallel``
    creates). Expert combinations are keyed by their expert names (``etp``, ``ep``, ``edp``)."""
    out = {}
    for axes in DENSE_GROUPS + EXPERT_GROUPS:
        view, digits = dense_or_expert(axes)
        view_sizes = sizes.dense() if view == "dense" else sizes.expert()
        out[frozenset(axes)] = rank_groups(sizes.world_size, view_sizes, sizes.order, digits)
    for tp_ranks in out[frozenset({"tp"})]:  # the grid inside each tensor group (none under 1d)
        for axes, groups in tp_grid_groups(tp_ranks, sizes.tp_mode, sizes.tp_depth).items():
            out.setdefault(frozenset(axes), []).extend(groups)
    return out


def embedding_group_ranks(pp_groups: list[list[int]]) -> list[list[int]]:
    """First and last stage of each pipeline (one rank when PP = 1)."""
    return [sorted({g[0], g[-1]}) for g in pp_groups]


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
    tensor_parallel_mode: str = "1d",
    tensor_parallel_depth: int = 1,
    device: torch.device | None = None,
    timeout: timedelta | None = None,
) -> ParallelState:
    """Build every group of both views (and the embedding groups) on an initialised world.

    If no process group is initialised, a world of one is created (plain single-process run). All
    ranks must call this with the same sizes; groups are created in the same order everywhere.
    Sizes that do not factor the world are refused (one line, the numbers) before any group.
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
    sizes = mesh_sizes(
        world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        order=order,
        tensor_parallel_mode=tensor_parallel_mode,
        tensor_parallel_depth=tensor_parallel_depth,
    )
    backend = dist.get_backend()
    made: dict[tuple, dict[tuple, object]] = {}  # one process group per distinct partition

    def create(partition: list[list[int]]) -> tuple[object, list[int]]:
        key = tuple(sorted(tuple(sorted(g)) for g in partition))
        if key not in made:  # every rank calls new_group for every group, in the same order
            made[key] = {
                tuple(sorted(g)): dist.new_group(g, backend=backend, timeout=timeout)
                for g in partition
            }
        (mine,) = [g for g in partition if rank in g]
        return made[key][tuple(sorted(mine))], mine

    groups = {axes: create(partition) for axes, partition in all_group_ranks(sizes).items()}
    # the embedding groups: first and last stage of each pipeline; middle stages are in none
    embedding = embedding_group_ranks(rank_groups(world_size, sizes.dense(), order, ["pp"]))
    emb_groups = [dist.new_group(g, backend=backend, timeout=timeout) for g in embedding]
    mine = [emb_groups[i] for i, g in enumerate(embedding) if rank in g]
    pp_ranks = groups[frozenset({"pp"})][1]
    if backend == "gloo" and world_size > 1:
        # gloo connects every pair of a group while the group is made, and a rank returns from
        # new_group once its own pairs are up: without this barrier a rank that finishes early
        # and destroys its groups (a mesh built and dropped, no collective between) closes
        # sockets a slower rank still needs for a group it is connecting ("Connection closed by
        # peer" in connectFullMesh, seen in 1 of 5 runs of a mesh-only test on a loaded machine)
        dist.barrier(group=dist.group.WORLD)
    return ParallelState(
        sizes=sizes,
        global_rank=rank,
        groups=groups,
        embedding=(mine[0] if mine else None, sorted({pp_ranks[0], pp_ranks[-1]})),
        device=device or torch.device("cpu"),
        backend=backend,
        world_group=dist.group.WORLD,
    )


__all__ = [
    "ParallelState",
    "default_backend",
    "init_single_process",
    "initialize_model_parallel",
]
