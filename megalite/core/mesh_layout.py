"""The rank layout of the mesh, as pure functions: which global ranks form each group.

Five axes, Megatron's names and default order ``tp-cp-ep-dp-pp`` (first = fastest)::

    rank = tp_rank + TP * (cp_rank + CP * (ep_rank + EP * (dp_rank + DP * pp_rank)))

i.e. a rank's coordinate on each axis is its mixed-radix digit, the sizes taken in ``order``. A TP
group is TP consecutive ranks (one node: its traffic stays on NVLink) and PP, the slowest axis,
crosses nodes. Another ``order`` (e.g. ``tp-cp-ep-pp-dp``) permutes the digits.

One world, two views ("parallel folding", as Megatron-core): the **dense view** has sizes
``tp, cp, dp, pp`` (ep = 1) and serves attention and dense layers; the **expert view** has sizes
``etp, ep, edp, pp`` (cp = 1; etp in the tp digit, edp in the dp digit) and serves MoE experts.
Both use the same order string, and they must share the pipeline groups: a pipeline group is the
ranks ``k * S`` apart, ``S`` the product of the sizes of the axes before ``pp`` in ``order``, so the
views share them exactly when PP = 1 or ``S`` is the same in both. In the default order (pp last)
``S`` = world / PP in both; in ``tp-cp-ep-pp-dp`` it is ``tp x cp`` against ``etp x ep``, and a
layout where they differ (world 4, PP 2, EP 2: dense pipelines [[0, 1], [2, 3]], expert
[[0, 2], [1, 3]]) would put one expert group across two stages: ``mesh_sizes`` refuses it, as
Megatron-core asserts.

Inside one TP group, the 2D and 2.5D tensor-parallel modes lay their ``tp_size = d x q x q`` ranks
out as a grid (2D: d = 1) with the column fastest::

    tp_rank = col + q * (row + q * depth)

and their sub-axes ``tp_col``, ``tp_row``, ``tp_depth`` follow the mesh's rule: the group over an
axis holds the ranks that differ only in that coordinate (``tp_col``: one grid row, its q columns).
``tp_grid_groups`` lists them for one TP group; 1d builds none. 3d's cube has its own three axes
``tp_input``, ``tp_weight``, ``tp_output`` (``tp_rank = input + q * (weight + q * output)``, the
layout of ``tensor_parallel.modes.grid3d``).

``rank_groups`` builds the same groups, in the same order, as Megatron-core's ``RankGenerator``
for the same sizes and order, so NCCL topology assumptions of Megatron scripts carry over.
No process groups here: everything is testable without ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

from megalite.core.tensor_parallel.modes.grid3d import SUB_AXES_3D, grid3d_groups

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
EXPERT_AXES = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}  # expert name -> digit it uses
TP_MODES = ("1d", "2d", "2.5d", "3d")
# the sub-axes of the tensor group each mode builds (group over an axis: its coordinate varies)
# (2d is 2.5d with depth 1: its tp_depth groups have one rank, so one set of layers serves both)
GRID_AXES = ("tp_col", "tp_row", "tp_depth")
GRID3D_AXES = tuple(f"tp_{a}" for a in SUB_AXES_3D)  # tp_input, tp_weight, tp_output
TP_GRID_AXES = {"1d": (), "2d": GRID_AXES, "2.5d": GRID_AXES, "3d": GRID3D_AXES}


def parse_order(order: str) -> list[str]:
    """``"tp-cp-ep-dp-pp"`` -> the axes, fastest first; axes left out are appended (size 1)."""
    names = [a for a in order.lower().split("-") if a]
    unknown = [a for a in names if a not in AXES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"order {order!r} must name each of {'-'.join(AXES)} at most once, separated by '-'"
        )
    return names + [a for a in AXES if a not in names]


def check_order_sizes(order: str, sizes: Mapping[str, int]) -> list[str]:
    """The parsed order; an axis left out of ``order`` must have size 1."""
    names = [a for a in order.lower().split("-") if a]
    for axis in AXES:
        if axis not in names and sizes.get(axis, 1) != 1:
            raise ValueError(
                f"order {order!r} leaves out axis {axis!r} whose size is {sizes[axis]}; name it"
            )
    return parse_order(order)


def rank_groups(
    world_size: int, sizes: Mapping[str, int], order: str, axes: Sequence[str]
) -> list[list[int]]:
    """Every group spanning ``axes`` (ranks that differ only in those axes' coordinates).

    ``sizes``: axis -> size for the axes of ``AXES`` (missing = 1); their product must be
    ``world_size``. Groups are listed with the other axes' coordinates counting up (the fastest
    first) and each group's members with ``axes``' coordinates counting up in ``order``; this is
    Megatron-core's ``RankGenerator.get_ranks`` for the same arguments.
    """
    names = check_order_sizes(order, sizes)
    for axis in axes:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; the axes are {', '.join(AXES)}")
    ordered = [sizes.get(a, 1) for a in names]
    if any(not isinstance(s, int) or s < 1 for s in ordered):
        raise ValueError(
            f"every axis size must be an integer >= 1, got {dict(zip(names, ordered))}"
        )
    if prod(ordered) != world_size:
        shown = " x ".join(f"{a} {s}" for a, s in zip(names, ordered))
        raise ValueError(f"world size {world_size} != {shown} = {prod(ordered)}")
    strides = [prod(ordered[:i]) for i in range(len(ordered))]

    def counting(dims: list[int]) -> list[int]:
        """The rank offsets of every coordinate on ``dims``, the first dim counting fastest."""
        out = [0]
        for i in dims:
            out = [base + d * strides[i] for d in range(ordered[i]) for base in out]
        return out

    # a member's offset from its group's first rank, the same for every group
    offsets = counting([i for i, a in enumerate(names) if a in axes])
    bases = counting([i for i, a in enumerate(names) if a not in axes])
    return [[base + offset for offset in offsets] for base in bases]


def rank_coords(rank: int, sizes: Mapping[str, int], order: str) -> dict[str, int]:
    """The coordinate of global ``rank`` on every axis (its mixed-radix digits in ``order``)."""
    coords = {}
    for axis in parse_order(order):
        size = sizes.get(axis, 1)
        coords[axis] = rank % size
        rank //= size
    return coords


@dataclass(frozen=True)
class MeshSizes:
    """Validated sizes of both views of one world; ``etp`` defaults to ``tp`` (Megatron's)."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = DEFAULT_ORDER
    tp_mode: str = "1d"  # one of TP_MODES: how a layer is split inside the tp group
    tp_depth: int = 1  # 2.5d: the d stacked q x q grids

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def dense(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    def expert(self) -> dict[str, int]:
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}


def mesh_sizes(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
    tensor_parallel_mode: str = "1d",
    tensor_parallel_depth: int = 1,
) -> MeshSizes:
    """Check that both views factor ``world_size`` and that the tensor group fits its mode's grid
    (``tp_grid_side``); one-line ValueError naming the numbers."""
    etp = expert_tensor_parallel_size
    if etp is None:
        etp = tensor_model_parallel_size
    named = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": etp,
    }
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    pp_name = "pipeline_model_parallel_size"
    for names in (  # the dense view, the expert view
        ("tensor_model_parallel_size", "context_parallel_size", pp_name),
        ("expert_tensor_parallel_size", "expert_model_parallel_size", pp_name),
    ):
        factors = [named[n] for n in names]
        if world_size % prod(factors) != 0:
            view, shown = " x ".join(names), " x ".join(str(f) for f in factors)
            raise ValueError(
                f"world size {world_size} is not divisible by {view} = {shown} = {prod(factors)}; "
                f"launch a multiple of {prod(factors)} processes or change the sizes"
            )
    tp_grid_side(tp, tensor_parallel_mode, tensor_parallel_depth)
    sizes = MeshSizes(
        world_size,
        tp=tp,
        cp=cp,
        pp=pp,
        ep=ep,
        etp=etp,
        order=order,
        tp_mode=tensor_parallel_mode,
        tp_depth=tensor_parallel_depth,
    )
    check_order_sizes(order, sizes.dense())
    check_order_sizes(order, sizes.expert())
    check_shared_pipelines(sizes)
    return sizes


def pipeline_stride(sizes: Mapping[str, int], order: str) -> int:
    """Ranks between two stages of one pipeline: the product of the sizes before ``pp``."""
    names = parse_order(order)
    return prod(sizes.get(a, 1) for a in names[: names.index("pp")])


def check_shared_pipelines(sizes: MeshSizes) -> None:
    """The dense and the expert view have the same pipeline groups (module docstring), else a
    one-line ValueError naming the sizes."""
    dense = pipeline_stride(sizes.dense(), sizes.order)
    expert = pipeline_stride(sizes.expert(), sizes.order)
    if sizes.pp == 1 or dense == expert:
        return
    names = parse_order(sizes.order)
    below = names[: names.index("pp")]
    dense_axes = [a for a in below if a in ("tp", "cp", "dp")]
    expert_axes = [a for a in below if a in ("tp", "ep", "dp")]
    params = {
        "tp": ("tensor_model_parallel_size", "expert_tensor_parallel_size"),
        "cp": ("context_parallel_size", None),
        "ep": (None, "expert_model_parallel_size"),
        "dp": ("the data-parallel size", "the expert data-parallel size"),
    }
    d_view, e_view = sizes.dense(), sizes.expert()
    d_text = " x ".join(f"{params[a][0]} {d_view[a]}" for a in dense_axes)
    e_text = " x ".join(f"{params[a][1]} {e_view[a]}" for a in expert_axes)
    raise ValueError(
        f"rank order {sizes.order} with pipeline_model_parallel_size {sizes.pp} splits pipeline "
        f"stages: they are {d_text} = {dense} ranks apart in the dense view but {e_text} = "
        f"{expert} in the expert view, so an expert group would span two stages; make the two "
        f"products equal or put pp last (order {DEFAULT_ORDER})"
    )


def dense_or_expert(axes: Sequence[str]) -> tuple[str, list[str]]:
    """``("dense", digits)`` or ``("expert", digits)`` for a combination of axis names; the expert
    names ``etp``/``edp`` map onto the tp/dp digits of the expert view. ``pp`` alone is dense (the
    views share it); mixing dense-only (tp, cp, dp) and expert-only (etp, ep, edp) is an error."""
    dense_only, expert_only = {"tp", "cp", "dp"}, {"etp", "ep", "edp"}
    if set(axes) & dense_only and set(axes) & expert_only:
        raise ValueError(
            f"axes {tuple(axes)} mix the dense view (tp, cp, dp) and the expert view (etp, ep, edp)"
        )
    unknown = set(axes) - dense_only - expert_only - {"pp"}
    if unknown:
        raise ValueError(
            f"unknown axis {sorted(unknown)[0]!r}; axes are tp, cp, dp, pp (dense) and etp, ep, "
            "edp, pp (expert)"
        )
    if set(axes) & expert_only:
        return "expert", [EXPERT_AXES[a] for a in axes]
    return "dense", list(axes)


def tp_grid_side(tp_size: int, mode: str, depth: int = 1) -> int:
    """The grid side q of ``mode`` over ``tp_size`` ranks (1d: tp_size): 2d needs q x q ranks,
    2.5d d x q x q, 3d q x q x q; a one-line ValueError with the nearest fitting sizes otherwise."""
    if mode not in TP_MODES:
        raise ValueError(f"tensor_parallel_mode must be one of {', '.join(TP_MODES)}, got {mode!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"tensor_parallel_depth must be an integer >= 1, got {depth!r}")
    if mode != "2.5d" and depth != 1:
        raise ValueError(
            f"tensor_parallel_depth {depth} applies to tensor_parallel_mode 2.5d only, not {mode}; "
            "drop it or use 2.5d"
        )
    if mode == "1d":
        return tp_size
    power, per_grid = (3, 1) if mode == "3d" else (2, depth)
    q = round((tp_size / per_grid) ** (1 / power))
    if per_grid * q**power != tp_size:
        shape = {"2d": "q x q", "2.5d": f"depth {depth} x q x q", "3d": "q x q x q"}[mode]
        fits = [per_grid * k**power for k in range(1, 9)]
        raise ValueError(
            f"tensor_model_parallel_size {tp_size} is not {shape} for tensor_parallel_mode "
            f"{mode}; use one of {', '.join(str(f) for f in fits[:5])}, ..."
        )
    return q


def tp_grid_groups(
    tp_ranks: Sequence[int], mode: str, depth: int = 1
) -> dict[tuple[str, ...], list[list[int]]]:
    """The sub-axis groups of one TP group (its global ranks in tp_rank order) under ``mode``:
    a combination of sub-axes (each of ``TP_GRID_AXES[mode]`` alone, and ``("tp_row",
    "tp_depth")``, over which a replicated weight's grad is summed) -> its groups, each listing
    global ranks with the varying coordinates counting up (the fastest first). Grid coordinates:
    ``tp_rank = col + q * (row + q * depth)`` (module docstring)."""
    q = tp_grid_side(len(tp_ranks), mode, depth)
    if mode == "3d":  # its own three axes, from the cube's pure layout (``grid3d.py``)
        cube = grid3d_groups(tp_ranks, q)
        return {(f"tp_{axis}",): cube[axis] for axis in SUB_AXES_3D}
    if mode == "1d":
        return {}
    coords = [(c, r, k) for k in range(depth) for r in range(q) for c in range(q)]
    where = dict(zip(coords, tp_ranks))
    combos = [(axis,) for axis in TP_GRID_AXES[mode]] + [("tp_row", "tp_depth")]
    out: dict[tuple[str, ...], list[list[int]]] = {}
    for axes in combos:
        keys = sorted({_without(c, axes) for c in coords}, key=lambda f: f[::-1])
        out[axes] = [[where[c] for c in coords if _without(c, axes) == key] for key in keys]
    return out


def _without(coord: tuple[int, int, int], axes: Sequence[str]) -> tuple[int, ...]:
    """``(col, row, depth)`` with ``axes``' coordinates dropped: the key of their group."""
    drop = {GRID_AXES.index(a) for a in axes}
    return tuple(v for i, v in enumerate(coord) if i not in drop)
