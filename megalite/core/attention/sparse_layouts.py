"""Block-sparse attention layouts (DeepSpeed's sparse-attention family), as bool # [nb, nb] over
blocks of positions: entry (i, j) True when query block i may read key block j. A layout is ANDed
with the causal mask (and any window or documents) by ``masks``; the diagonal is always kept.

    fixed       local: blocks in the same run of ``num_local_blocks``; strided: the last
                ``num_global_blocks`` blocks of every run, read by all later blocks (Child et al.)
    bigbird     a sliding window of ``num_window_blocks`` blocks, ``num_global_blocks`` first
                blocks read by and reading all, ``num_random_blocks`` random earlier blocks per row
                (seeded)
    longformer  a sliding window of ``num_window_blocks`` blocks, and global blocks (the blocks of
                the global tokens) read by and reading all
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPARSE_LAYOUTS = ("fixed", "bigbird", "longformer")


def _window(nb: int, num_window_blocks: int) -> torch.Tensor:
    """|i - j| <= w // 2: a window of w blocks centred on the diagonal (w odd; even rounds down)."""
    i = torch.arange(nb)
    return (i[:, None] - i[None, :]).abs() <= num_window_blocks // 2


@dataclass(frozen=True)
class FixedLayout:
    num_local_blocks: int = 4
    num_global_blocks: int = 1

    def __post_init__(self):
        if self.num_local_blocks < 1 or not 0 <= self.num_global_blocks <= self.num_local_blocks:
            raise ValueError(
                f"fixed layout needs num_local_blocks >= 1 and 0 <= num_global_blocks <= "
                f"num_local_blocks, got {self.num_local_blocks} and {self.num_global_blocks}"
            )

    def __call__(self, nb: int) -> torch.Tensor:
        i = torch.arange(nb)
        local = (i[:, None] // self.num_local_blocks) == (i[None, :] // self.num_local_blocks)
        strided = (i % self.num_local_blocks) >= self.num_local_blocks - self.num_global_blocks
        return local | strided[None, :]


@dataclass(frozen=True)
class BigBirdLayout:
    num_window_blocks: int = 3
    num_global_blocks: int = 1
    num_random_blocks: int = 1
    seed: int = 0

    def __post_init__(self):
        if min(self.num_window_blocks - 1, self.num_global_blocks, self.num_random_blocks) < 0:
            raise ValueError(
                f"bigbird layout needs num_window_blocks >= 1, num_global_blocks >= 0 and "
                f"num_random_blocks >= 0, got {self.num_window_blocks}, "
                f"{self.num_global_blocks} and {self.num_random_blocks}"
            )

    def __call__(self, nb: int) -> torch.Tensor:
        out = _window(nb, self.num_window_blocks)
        out[: self.num_global_blocks] = True
        out[:, : self.num_global_blocks] = True
        gen = torch.Generator().manual_seed(self.seed)
        for i in range(1, nb):  # random earlier blocks (the causal mask hides later ones)
            pick = torch.randperm(i, generator=gen)[: self.num_random_blocks]
            out[i, pick] = True
        return out


@dataclass(frozen=True)
class LongformerLayout:
    num_window_blocks: int = 3
    global_blocks: tuple[int, ...] = (0,)

    def __post_init__(self):
        if self.num_window_blocks < 1 or any(g < 0 for g in self.global_blocks):
            raise ValueError(
                f"longformer layout needs num_window_blocks >= 1 and global block indices >= 0, "
                f"got {self.num_window_blocks} and {list(self.global_blocks)}"
            )

    def __call__(self, nb: int) -> torch.Tensor:
        out = _window(nb, self.num_window_blocks)
        glob = [g for g in self.global_blocks if g < nb]
        out[glob] = True
        out[:, glob] = True
        return out


def build_layout(
    name: str,
    *,
    num_local_blocks: int = 4,
    num_global_blocks: int = 1,
    num_window_blocks: int = 3,
    num_random_blocks: int = 1,
    global_blocks: tuple[int, ...] = (0,),
    seed: int = 0,
):
    """The layout called ``name`` (one of ``SPARSE_LAYOUTS``) with its parameters."""
    if name == "fixed":
        return FixedLayout(num_local_blocks, num_global_blocks)
    if name == "bigbird":
        return BigBirdLayout(num_window_blocks, num_global_blocks, num_random_blocks, seed)
    if name == "longformer":
        return LongformerLayout(num_window_blocks, tuple(global_blocks))
    raise ValueError(f"sparse_attention must be one of {', '.join(SPARSE_LAYOUTS)}, got {name!r}")
