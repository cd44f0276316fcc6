"""Tensor-parallel modes beyond Megatron's 1d: the layers of the 2d (Optimus, SUMMA) and 2.5d
(Tesseract) grids and of the 3d cube (``mode3d.py``), which split activations as well as weights
inside the tensor group.

The grid and its sub-axes are the mesh's (``megalite.core.mesh_layout.tp_grid_groups``); a layer
takes a ``Grid`` (its four groups). 2d is 2.5d with depth 1, so one set of layers serves both.
"""

from megalite.core.tensor_parallel.modes.grid import Grid, check_grid_dims
from megalite.core.tensor_parallel.modes.grid_layers import (
    GridEmbedding,
    GridLayerNorm,
    GridLinear,
    GridRMSNorm,
    grid_cross_entropy,
)
from megalite.core.tensor_parallel.modes.mode import GridMode, OneD, tensor_parallel_mode
from megalite.core.tensor_parallel.modes.mode3d import Mode3D, check_cube_dims

__all__ = [
    "Grid",
    "GridEmbedding",
    "GridLayerNorm",
    "GridLinear",
    "GridMode",
    "Mode3D",
    "OneD",
    "GridRMSNorm",
    "check_cube_dims",
    "check_grid_dims",
    "grid_cross_entropy",
    "tensor_parallel_mode",
]
