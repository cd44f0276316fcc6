"""The groups a 2d / 2.5d layer communicates over, and where this rank sits in its grid.

A tensor group of ``d x q x q`` ranks (2d: d = 1) is ``d`` stacked ``q x q`` grids (Tesseract);
``tp_rank = col + q * (row + q * depth)``. Activations ``[s, b, h]`` are split over all three:

    x on (depth, row, col):  [s, b / (d q), h / q]   batch block depth * q + row, hidden block col
    a linear's weight [out, in] on (depth, row, col):  [out / q, in / q]   out block col,
                              in block row; the d grids hold the same blocks (replicated over depth)

The groups are named by the coordinate that varies in them (the mesh's rule): ``col_group`` is one
grid row (q ranks), ``row_group`` one grid column, ``depth_group`` the same cell of the d grids,
``row_depth_group`` the d x q ranks that hold the same column block of a weight or a bias.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.groups import group_rank, group_size


@dataclass(frozen=True)
class Grid:
    """The four sub-axis groups of one rank's tensor group (None: a group of one)."""

    col_group: object = None
    row_group: object = None
    depth_group: object = None
    row_depth_group: object = None

    @classmethod
    def of(cls, ps) -> Grid:
        """The grid of a ``ParallelState`` built with a 2d or 2.5d ``tensor_parallel_mode``."""
        return cls(
            ps.group("tp_col"),
            ps.group("tp_row"),
            ps.group("tp_depth"),
            ps.group("tp_row", "tp_depth"),
        )

    @property
    def q(self) -> int:
        return group_size(self.col_group)

    @property
    def depth(self) -> int:
        return group_size(self.depth_group)

    @property
    def col(self) -> int:
        return group_rank(self.col_group)

    @property
    def row(self) -> int:
        return group_rank(self.row_group)

    @property
    def depth_rank(self) -> int:
        return group_rank(self.depth_group)

    @property
    def batch_blocks(self) -> int:
        """How many blocks the batch dim is cut into: d x q."""
        return self.depth * self.q

    @property
    def batch_block(self) -> int:
        """This rank's block of the batch dim: ``depth_rank * q + row``."""
        return self.depth_rank * self.q + self.row


def check_grid_dims(
    q: int,
    depth: int,
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: int,
    micro_batch_size: int,
) -> None:
    """The model's dims on a ``depth x q x q`` grid: hidden, heads, query groups and ffn split over
    q (the vocabulary is padded to a multiple of q); the micro-batch over depth x q. One-line
    ValueError naming the parameter, the numbers and the fix."""
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_attention_heads", num_attention_heads),
        ("num_query_groups", num_query_groups),
        ("ffn_hidden_size", ffn_hidden_size),
    ):
        if value % q:
            raise ValueError(
                f"{name} {value} is not divisible by the grid side q = {q} of the tensor-parallel "
                f"grid (it splits {name} into q blocks); use a multiple of {q}"
            )
    if micro_batch_size % (depth * q):
        raise ValueError(
            f"micro_batch_size {micro_batch_size} is not divisible by tensor_parallel_depth "
            f"{depth} x q {q} = {depth * q} (the grid splits each micro-batch into depth x q "
            f"blocks of whole sequences); use a multiple of {depth * q}"
        )
