"""How each tensor-parallel mode holds a logical tensor, and back: one rule per mode, by parameter
name. ``merge_shards`` (a checkpoint's TP shards -> the full tensor) and ``split_shard`` (the full
tensor -> a rank's shard) take the ``TPLayout`` (mode, size, depth) of either side, so a checkpoint
of any mode reshards into any other (``resharding``).

1d (Megatron's): ``tp_split`` names the dim a parameter is split along, in ``stride`` stacked
blocks (SwiGLU's ``[gate; up]``); the vocabulary rows are padded to the run's padded size first.

Grid (2d is 2.5d with depth 1; ``megalite.core.tensor_parallel.modes``): TP rank
``t = col + q * (row + q * depth)`` holds

    a linear's weight [out, in]      out block col (of each stride part) x in block row
    a linear's bias, a norm's scale  block col (of each stride part)
    the vocabulary table [V_pad, h]  rows block row x columns block col (embedding and output)
    the position table [P, h]        columns block col

and every depth holds the same blocks (the ranks of depth 0, ``t < q * q``, give the whole tensor).

Cube (3d): TP rank ``t = input + q * (weight + q * output)`` holds (``layers3d.py``,
``vocab3d.py``; a linear's input layout is ``residual`` for linear_qkv and linear_fc1, ``inner``
for linear_proj and linear_fc2; its row rank is ``input`` and ``output`` respectively, its hidden
rank the other one)

    a linear's weight [out, in]      out block (row rank * q + weight) of q^2 (of each stride
                                     part) x in block hidden rank of q
    a linear's bias [out]            the weight's out block (equal over the hidden rank)
    a norm's scale [h], positions    hidden block output of q (equal over input and weight)
    the vocabulary table [V_pad, h]  rows block input of q x columns block output * q + weight
                                     of q^2 (embedding and output)

The cube's block functions are the layers' own (``weight_block3d``, ``embedding_block3d``), so a
rank's block here is the one its layer initialises. The grid and cube merges and splits see the
vocabulary padded; ``merge_shards`` unpads it and ``split_shard`` pads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.core.mesh_layout import tp_grid_side
from megalite.core.tensor_parallel.modes.grid3d import SUB_AXES_3D, Groups3D
from megalite.core.tensor_parallel.modes.layers3d import weight_block3d
from megalite.core.tensor_parallel.modes.vocab3d import embedding_block3d

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_COLUMN = ("linear_qkv", "linear_fc1")  # 3d input layout "residual"
_ROW = ("linear_proj", "linear_fc2")  # 3d input layout "inner"


@dataclass(frozen=True)
class TPLayout:
    """A tensor group's layout: ``mode`` (1d, 2d, 2.5d, 3d), ``size`` ranks, ``depth`` (2.5d)."""

    mode: str = "1d"
    size: int = 1
    depth: int = 1

    @classmethod
    def of(cls, ps) -> TPLayout:
        """The layout of a ``ParallelState``'s tensor group."""
        return cls(ps.sizes.tp_mode, ps.tp_size, ps.sizes.tp_depth)

    @property
    def q(self) -> int:
        """The side of the grid (size / depth = q^2) or the cube (size = q^3); the size under 1d."""
        return tp_grid_side(self.size, self.mode, self.depth)

    def __str__(self) -> str:
        """``TP 8`` (1d), ``TP 4 (2d)``, ``TP 8 (2.5d, depth 2)``: the log lines' form."""
        if self.mode == "1d":
            return f"TP {self.size}"
        depth = f", depth {self.depth}" if self.mode == "2.5d" else ""
        return f"TP {self.size} ({self.mode}{depth})"


def is_vocab(name: str) -> bool:
    """A tensor whose rows are the (padded) vocabulary: the word embedding, the output layer."""
    return name.endswith(WORD_EMBEDDING) or name == OUTPUT_LAYER


# --- the grid and the cube -----------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """What a parameter is to a grid: ``kind`` vocab / position / hidden (a norm's scale or
    shift) / linear; a linear's ``layout`` (its 3d input layout), ``stride`` and ``bias``."""

    kind: str
    layout: str = "residual"
    stride: int = 1
    bias: bool = False


def _part(name: str, *, swiglu: bool) -> _Part:
    if is_vocab(name):
        return _Part("vocab")
    if name.endswith("position_embeddings.weight"):
        return _Part("position")
    module, kind = name.split(".")[-2:]
    if module in _COLUMN or module in _ROW:
        stride = 2 if swiglu and module == "linear_fc1" else 1
        layout = "residual" if module in _COLUMN else "inner"
        return _Part("linear", layout, stride, bias=kind == "bias")
    if module.endswith("layernorm"):
        return _Part("hidden")
    raise CheckpointError(f"{name}: no tensor-parallel grid or cube rule splits this parameter")


def _strided(blocks: list[torch.Tensor], stride: int) -> torch.Tensor:
    """The out dim of a linear from its out blocks (in order), each ``stride`` stacked parts:
    part 0 of every block, then part 1, ..."""
    parts = [b.chunk(stride, dim=0) for b in blocks]
    return torch.cat([p[j] for j in range(stride) for p in parts], dim=0)


def merge_grid(shards: list[torch.Tensor], name: str, *, q: int, swiglu: bool) -> torch.Tensor:
    """The full (vocabulary still padded) tensor of ``name`` from its grid blocks, TP rank order
    (the first ``q * q`` are read)."""
    part = _part(name, swiglu=swiglu)

    def at(row: int, col: int) -> torch.Tensor:
        return shards[col + q * row]

    if part.kind == "vocab":
        return torch.cat([torch.cat([at(r, c) for c in range(q)], dim=1) for r in range(q)])
    if part.kind == "position":
        return torch.cat([at(0, c) for c in range(q)], dim=1)
    if part.kind == "hidden":
        return torch.cat([at(0, c) for c in range(q)])
    if part.bias:
        return _strided([at(0, c) for c in range(q)], part.stride)
    columns = [torch.cat([at(r, c) for r in range(q)], dim=1) for c in range(q)]
    return _strided(columns, part.stride)


def split_grid(
    full: torch.Tensor, name: str, *, q: int, tp_rank: int, swiglu: bool
) -> torch.Tensor:
    """TP rank ``tp_rank``'s grid block of the full (vocabulary padded) tensor of ``name``."""
    part = _part(name, swiglu=swiglu)
    col, row = tp_rank % q, (tp_rank // q) % q
    if part.kind == "vocab":
        return full.chunk(q, dim=0)[row].chunk(q, dim=1)[col]
    if part.kind == "position":
        return full.chunk(q, dim=1)[col]
    if part.kind == "hidden":
        return full.chunk(q)[col]
    out = torch.cat([b.chunk(q)[col] for b in full.chunk(part.stride)])
    return out if part.bias else out.chunk(q, dim=1)[row]


def merge_cube(shards: list[torch.Tensor], name: str, *, q: int, swiglu: bool) -> torch.Tensor:
    """The full (vocabulary still padded) tensor of ``name`` from its 3d blocks, TP rank order."""
    part = _part(name, swiglu=swiglu)

    def at(input_rank: int, weight_rank: int, output_rank: int) -> torch.Tensor:
        return shards[input_rank + q * (weight_rank + q * output_rank)]

    if part.kind == "vocab":  # columns block c = output * q + weight
        rows = [torch.cat([at(i, c % q, c // q) for c in range(q * q)], dim=1) for i in range(q)]
        return torch.cat(rows)
    if part.kind == "position":
        return torch.cat([at(0, 0, o) for o in range(q)], dim=1)
    if part.kind == "hidden":
        return torch.cat([at(0, 0, o) for o in range(q)])

    def block(k: int, hidden: int) -> torch.Tensor:
        """Out block k = row rank * q + weight of q^2, in block ``hidden``."""
        row, weight = divmod(k, q)
        return at(row, weight, hidden) if part.layout == "residual" else at(hidden, weight, row)

    if part.bias:
        return _strided([block(k, 0) for k in range(q * q)], part.stride)
    rows = [torch.cat([block(k, c) for c in range(q)], dim=1) for k in range(q * q)]
    return _strided(rows, part.stride)


def split_cube(
    full: torch.Tensor, name: str, *, q: int, tp_rank: int, swiglu: bool
) -> torch.Tensor:
    """TP rank ``tp_rank``'s 3d block of the full (vocabulary padded) tensor of ``name``."""
    part = _part(name, swiglu=swiglu)
    g = Groups3D.of(dict.fromkeys(SUB_AXES_3D), q, tp_rank)  # coordinates only, no groups
    if part.kind == "vocab":
        return embedding_block3d(full, g)
    if part.kind == "position":
        return full.chunk(q, dim=1)[g.output_rank]
    if part.kind == "hidden":
        return full.chunk(q)[g.output_rank]
    return weight_block3d(full, g, part.layout, stride=part.stride)


# --- 1d, and every mode --------------------------------------------------------------------


@dataclass(frozen=True)
class TPSplit:
    """How one parameter is split over TP: along ``dim`` (None: replicated) in ``stride`` blocks;
    ``vocab``: its rows are the padded vocabulary."""

    dim: int | None
    stride: int = 1
    vocab: bool = False


def tp_split(name: str, *, swiglu: bool) -> TPSplit:
    """The documented split of parameter ``name`` (local or global). The layers' own attributes
    (``partition_dim``, ``partition_stride``) agree; tests/checkpoint/test_checkpoint_reshard.py
    checks it."""
    if name.endswith(WORD_EMBEDDING) or name == OUTPUT_LAYER:
        return TPSplit(0, vocab=True)
    module, kind = name.split(".")[-2:]
    if module == "linear_qkv":  # whole query groups per rank: a plain row split
        return TPSplit(0)
    if module == "linear_fc1":
        return TPSplit(0, stride=2 if swiglu else 1)
    if module in ("linear_proj", "linear_fc2") and kind == "weight":
        return TPSplit(1)
    return TPSplit(None)


def merge_tp(shards: list[torch.Tensor], split: TPSplit, *, vocab_size: int) -> torch.Tensor:
    """TP shards (rank order) -> the full logical tensor."""
    if split.dim is None or len(shards) == 1:
        full = shards[0]
        return full.narrow(0, 0, vocab_size) if split.vocab else full
    d = split.dim
    if split.stride == 1:
        full = torch.cat(shards, dim=d)
    else:
        blocks = [s.chunk(split.stride, dim=d) for s in shards]
        full = torch.cat([b[j] for j in range(split.stride) for b in blocks], dim=d)
    return full.narrow(0, 0, vocab_size) if split.vocab else full


def pad_vocab(full: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """A vocabulary tensor's rows zero-padded to ``padded_vocab_size`` (this run's padding)."""
    if full.shape[0] > padded_vocab_size:
        raise CheckpointError(
            f"a vocabulary of {full.shape[0]} rows does not fit the padded vocabulary "
            f"{padded_vocab_size} of this run; check --vocab-size / the tokenizer"
        )
    padded = full.new_zeros(padded_vocab_size, *full.shape[1:])
    padded[: full.shape[0]] = full
    return padded


def split_tp(
    full: torch.Tensor, split: TPSplit, *, tp_size: int, tp_rank: int, padded_vocab_size: int
) -> torch.Tensor:
    """The full logical tensor -> TP rank ``tp_rank``'s shard (contiguous)."""
    if split.dim is None:
        return full
    if split.vocab:
        full = pad_vocab(full, padded_vocab_size)
    if tp_size == 1:
        return full.contiguous()
    d = split.dim
    blocks = full.chunk(split.stride, dim=d)
    return torch.cat([b.chunk(tp_size, dim=d)[tp_rank] for b in blocks], dim=d).contiguous()


def merge_shards(
    shards: list[torch.Tensor], name: str, tp: TPLayout, *, swiglu: bool, vocab_size: int
) -> torch.Tensor:
    """The TP shards of ``name`` (rank order) saved under ``tp`` -> its full logical tensor."""
    if tp.mode == "1d":
        return merge_tp(shards, tp_split(name, swiglu=swiglu), vocab_size=vocab_size)
    merge = merge_cube if tp.mode == "3d" else merge_grid  # 2d, 2.5d
    full = merge(shards, name, q=tp.q, swiglu=swiglu)
    return full.narrow(0, 0, vocab_size) if is_vocab(name) else full


def split_shard(
    full: torch.Tensor,
    name: str,
    tp: TPLayout,
    *,
    tp_rank: int,
    swiglu: bool,
    padded_vocab_size: int,
) -> torch.Tensor:
    """The full logical tensor of ``name`` -> TP rank ``tp_rank``'s shard under ``tp``
    (contiguous)."""
    if tp.mode == "1d":
        split = tp_split(name, swiglu=swiglu)
        return split_tp(
            full, split, tp_size=tp.size, tp_rank=tp_rank, padded_vocab_size=padded_vocab_size
        )
    if is_vocab(name):
        full = pad_vocab(full, padded_vocab_size)
    split = split_cube if tp.mode == "3d" else split_grid  # 2d, 2.5d
    return split(full, name, q=tp.q, tp_rank=tp_rank, swiglu=swiglu).contiguous()
