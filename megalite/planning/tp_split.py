"""What one device of a tensor group holds of a GPT under each tensor-parallel mode.

    split = TPSplit("3d", tp=8)
    split.q, split.batch_blocks          # 2, 4: heads / ffn / vocab in q, the micro-batch in q^2
    split.linear(out, in_, column=True)  # (weight, bias) elements of a linear on one device

Per device (``tensor_parallel/modes``; ``V`` the vocabulary padded to a multiple of
``make_vocab_size_divisible_by * q``, ``P`` the learned positions):

    mode          linear [O, I] weight / bias        norm scale   word table / output   positions
    1d  (p)       O I / p;  O / p column, O row      h            V/p x h               P x h
    2d, 2.5d      O I / q^2;  O / q                  h / q        V/q x h/q             P x h/q
    3d  (q^3)     O I / q^3;  O / q^2                h / q        V/q x h/q^2           P x h/q

and a micro-batch of ``b`` sequences in ``batch_blocks`` blocks (1d: whole; 2d / 2.5d: ``d q``;
3d: ``q^2``), each block's hidden states split in q (1d: whole, or sequence-split under SP).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.mesh_layout import tp_grid_side
from megalite.models.config import GPTConfig

GRID_MODES = ("2d", "2.5d")


@dataclass(frozen=True)
class TPSplit:
    """A tensor group of ``tp`` devices under ``mode`` (``depth``: 2.5d's stacked grids)."""

    mode: str = "1d"
    tp: int = 1
    depth: int = 1

    @property
    def q(self) -> int:
        """What heads, query groups, ffn and the vocabulary are split into (1d: tp)."""
        return tp_grid_side(self.tp, self.mode, self.depth)

    @property
    def batch_blocks(self) -> int:
        """The blocks a micro-batch's sequences are cut into, one per device of a grid column."""
        if self.mode in GRID_MODES:
            return self.depth * self.q
        return self.q * self.q if self.mode == "3d" else 1

    @property
    def hidden_blocks(self) -> int:
        """The blocks a hidden state's hidden dim is cut into (1d: none)."""
        return 1 if self.mode == "1d" else self.q

    def linear(self, out_size: int, in_size: int, *, column: bool) -> tuple[int, int]:
        """(weight, bias) elements of a linear ``[out, in]`` on one device; ``column``: 1d's
        column-parallel linear (its bias split), else a row-parallel one (its bias whole)."""
        q = self.q
        if self.mode == "1d":  # column: [O/p, I]; row: [O, I/p]
            if column:
                return out_size // q * in_size, out_size // q
            return out_size * (in_size // q), out_size
        if self.mode == "3d":  # [O/q^2, I/q]
            return out_size // (q * q) * (in_size // q), out_size // (q * q)
        return out_size // q * (in_size // q), out_size // q  # [O/q, I/q]

    def norm(self, hidden_size: int) -> int:
        """A norm's scale (or shift) elements on one device."""
        return hidden_size // self.hidden_blocks

    def vocab(self, c: GPTConfig) -> int:
        """The padded vocabulary rows of the word table (and the logits' columns) one device
        holds."""
        return c.padded_vocab_size(self.q) // self.q

    def table(self, c: GPTConfig) -> int:
        """Elements of the word embedding (or the untied output layer) on one device."""
        h = c.hidden_size
        if self.mode == "3d":
            return self.vocab(c) * (h // (self.q * self.q))
        return self.vocab(c) * h // self.hidden_blocks

    def positions(self, c: GPTConfig) -> int:
        """Elements of the learned position table on one device."""
        return c.max_position_embeddings * c.hidden_size // self.hidden_blocks
