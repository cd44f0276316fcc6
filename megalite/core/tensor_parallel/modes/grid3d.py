"""The rank layout of 3D tensor parallelism, as pure functions, and the groups a 3D layer uses.

3D TP (Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge Neural
Networks"; Colossal-AI's 3D mode) puts the ``p = q^3`` ranks of one TP group on a cube with three
sub-axes, ``input``, ``weight`` and ``output``. A rank's place in its TP group (``tp_rank``, 0 ..
p-1, in the order of the group's global ranks) gives its coordinates as mixed-radix digits, input
fastest::

    tp_rank = input_rank + q * (weight_rank + q * output_rank)

A sub-axis group is the q ranks that differ only in that coordinate (q^2 groups per sub-axis), so
an input group is q consecutive members of the TP group. ``layers3d.py`` says what each sub-axis
carries. No process groups are made here: the caller (a test, or the mesh) creates them over the
rank lists of ``grid3d_groups`` and hands them to ``Groups3D``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SUB_AXES_3D = ("input", "weight", "output")  # fastest first
_STRIDES = {"input": lambda q: 1, "weight": lambda q: q, "output": lambda q: q * q}


def grid3d_coords(tp_rank: int, q: int) -> dict[str, int]:
    """The coordinates of member ``tp_rank`` of a TP group of q^3: ``{input, weight, output}``."""
    return {
        "input": tp_rank % q,
        "weight": (tp_rank // q) % q,
        "output": tp_rank // (q * q),
    }


def grid3d_groups(tp_ranks: Sequence[int], q: int) -> dict[str, list[list[int]]]:
    """The global ranks of every group of each sub-axis, for one TP group whose global ranks are
    ``tp_ranks`` (in tp-rank order): ``{"input": [...], "weight": [...], "output": [...]}``, q^2
    groups of q ranks each, a group's members counting up along its sub-axis and the groups
    listed with the other two coordinates counting up (the faster one first)."""
    if q < 1 or len(tp_ranks) != q**3:
        raise ValueError(f"3D tensor parallelism needs q^3 ranks: got {len(tp_ranks)} for q {q}")
    out = {}
    for axis in SUB_AXES_3D:
        stride = _STRIDES[axis](q)
        others = [a for a in SUB_AXES_3D if a != axis]
        groups = []
        for slow in range(q):
            for fast in range(q):
                base = fast * _STRIDES[others[0]](q) + slow * _STRIDES[others[1]](q)
                groups.append([tp_ranks[base + m * stride] for m in range(q)])
        out[axis] = groups
    return out


def first_copy_ranks(replicated_over: Sequence[str], q: int) -> tuple[int, ...]:
    """The TP ranks holding the counted copy of a parameter replicated along ``replicated_over``:
    coordinate 0 on each of those sub-axes (all q^3 ranks for a parameter split over the cube)."""
    return tuple(
        r for r in range(q**3) if all(grid3d_coords(r, q)[a] == 0 for a in replicated_over)
    )


@dataclass(frozen=True)
class Groups3D:
    """What a 3D layer communicates over: the three sub-axis process groups of this rank (``None``
    is a group of one), the edge ``q`` and this rank's coordinates. ``Groups3D.single()`` is the
    whole cube in one process (q = 1): the same layers then compute without communication.

    Activations come in two layouts (``layers3d.py``): ``"residual"`` (the residual stream, norm,
    embedding and block outputs) and ``"inner"`` (QKV, attention, the ffn dim, logits)."""

    input_group: object
    weight_group: object
    output_group: object
    q: int
    input_rank: int
    weight_rank: int
    output_rank: int

    @classmethod
    def single(cls) -> Groups3D:
        return cls(None, None, None, 1, 0, 0, 0)

    @classmethod
    def of(cls, groups: dict[str, object], q: int, tp_rank: int) -> Groups3D:
        """From the process groups of this rank by sub-axis name, and its place in the TP group."""
        c = grid3d_coords(tp_rank, q)
        return cls(
            groups["input"], groups["weight"], groups["output"], q, *(c[a] for a in SUB_AXES_3D)
        )

    @staticmethod
    def hidden_axis(layout: str) -> str:
        """The sub-axis over which a ``layout`` activation's hidden dim is split."""
        return "output" if _check(layout) == "residual" else "input"

    @staticmethod
    def row_axis(layout: str) -> str:
        """The sub-axis over which a ``layout`` activation's q batch sub-blocks are spread."""
        return "input" if _check(layout) == "residual" else "output"

    def coord(self, axis: str) -> int:
        """This rank's coordinate on sub-axis ``axis``."""
        return (self.input_rank, self.weight_rank, self.output_rank)[SUB_AXES_3D.index(axis)]

    def holds_first_copy(self, param) -> bool:
        """Whether this rank holds the copy of a 3D parameter that counts (in a grad norm, say):
        coordinate 0 on each sub-axis of its ``tp3d_replicated_over``."""
        return all(self.coord(axis) == 0 for axis in param.tp3d_replicated_over)

    def hidden_group(self, layout: str):
        """The group over which a ``layout`` activation's hidden dim is split."""
        return self.output_group if _check(layout) == "residual" else self.input_group

    def hidden_rank(self, layout: str) -> int:
        return self.output_rank if _check(layout) == "residual" else self.input_rank

    def row_group(self, layout: str):
        """The group over which a ``layout`` activation's q batch sub-blocks are spread (the
        other sub-axis than ``weight`` and ``hidden_group``)."""
        return self.input_group if _check(layout) == "residual" else self.output_group

    def row_rank(self, layout: str) -> int:
        return self.input_rank if _check(layout) == "residual" else self.output_rank

    def batch_block(self, layout: str) -> int:
        """Which of the q^2 blocks of the batch dim a ``layout`` activation holds here."""
        return self.weight_rank * self.q + self.row_rank(layout)


LAYOUTS_3D = ("residual", "inner")


def _check(layout: str) -> str:
    if layout not in LAYOUTS_3D:
        raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS_3D)}")
    return layout


def other_layout(layout: str) -> str:
    """The layout a 3D linear layer returns for an input in ``layout``."""
    return "inner" if _check(layout) == "residual" else "residual"
