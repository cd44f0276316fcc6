"""Attention masks as block masks: which key blocks each query block needs.

A mask is the AND of pieces, each a predicate on (query position, key position), True where the
query may read the key:

    causal       k <= q
    window       q - left <= k <= q + right   (Megatron's window_size (left, right); -1: no bound)
    documents    doc(q) == doc(k)             (packed sequences, ``reset_attention_mask``)
    layout       layout[q // L, k // L]       (a block-sparse layout over blocks of L positions)

``build_block_plan`` cuts the queries and keys into blocks of ``block_size`` tokens (the last one
short when the length is not a multiple) and keeps exactly the blocks with at least one allowed
entry: each piece gives a block-level bound (``any``: the block may hold an allowed entry, from
the blocks' position and document ranges; ``all``: every entry is allowed), and the blocks that
are possible but not certain are checked entry by entry (a cost of the order of computing them).
Queries and keys carry their own positions (into the whole sequence), so the same plan serves a
context-parallel rank's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Entries of the token-level check done at once when the plan is built (bounded transient memory).
_CHECK_ENTRIES = 1 << 24


@dataclass(frozen=True)
class MaskSpec:
    """The pieces of a mask that do not depend on the data: causality, a window and a layout
    (``layout(num_blocks) -> bool # [nb, nb]`` over blocks of ``layout_block`` positions)."""

    causal: bool = True
    window: tuple[int, int] | None = None
    layout: object | None = None  # sparse_layouts.SparseLayout
    layout_block: int = 0

    def __post_init__(self):
        if self.window is not None:
            left, right = self.window
            if left < -1 or right < -1:
                raise ValueError(f"window_size must be >= -1 (-1: unbounded), got {self.window}")
        if self.layout is not None and self.layout_block <= 0:
            raise ValueError(f"layout_block must be positive, got {self.layout_block}")

    @property
    def band(self) -> tuple[float, float]:
        """(lo, hi): the allowed range of ``k - q`` from causality and the window."""
        lo, hi = -float("inf"), float("inf")
        if self.window is not None:
            left, right = self.window
            lo = -float("inf") if left < 0 else -left
            hi = float("inf") if right < 0 else right
        if self.causal:
            hi = min(hi, 0)
        return lo, hi


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of block-sparse attention: query blocks ``rows`` # [R] against key blocks
    ``cols`` # [R, c] (row i reads the blocks ``cols[i]``, increasing).

    ``row_start``: the rows are ``row_start .. row_start + R - 1`` (read as a slice), else None.
    ``band_start``: ``cols[i]`` is ``band_start + i + (0 .. c - 1)`` (a window's band: the keys are
    an overlapping strided view, no gather), else None. ``mask``: bool # [1, B, c * B], the entry
    mask every row shares, or None; ``per_row``: the rows' masks differ (``group_mask`` at each
    call). Neither: every entry is allowed, the call runs unmasked."""

    rows: torch.Tensor
    cols: torch.Tensor
    row_start: int | None
    band_start: int | None
    mask: torch.Tensor | None
    per_row: bool


@dataclass
class BlockPlan:
    """The blocks one sample computes. Queries and keys are padded to whole blocks.

    ``groups``: (rows # [R], cols # [R, c]) with every row of a group needing the same number c of
    key blocks (its columns in increasing order); every non-empty query block is in exactly one
    group. ``blocks``: bool # [nq, nk], the mask's non-empty blocks (what ``groups`` computes);
    ``full``: the blocks whose every entry is allowed (no mask needed there). ``band``: L when the
    mask is exactly a causal window of L keys back over one whole sequence (no documents, no
    layout, queries and keys at positions 0 .. s-1): ``band_attention`` computes it by tiles."""

    block_size: int
    sq: int
    sk: int
    spec: MaskSpec
    q_pos: torch.Tensor  # [nq * B] int64, padded entries -1
    k_pos: torch.Tensor  # [nk * B]
    q_doc: torch.Tensor | None
    k_doc: torch.Tensor | None
    blocks: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor]]
    _layout: torch.Tensor | None = None
    full: torch.Tensor | None = None
    band: int | None = None
    _calls: dict[int, list[BlockCall]] = field(default_factory=dict)
    flex_mask: object | None = None  # flex_sparse's BlockMask of this plan, built at first use

    @property
    def num_computed(self) -> int:
        return int(self.blocks.sum())

    def calls(self, max_entries: int) -> list[BlockCall]:
        """The groups cut into kernel calls of at most ``max_entries`` score entries (at least
        one row each), with their masks; built once per ``max_entries`` and kept (the plan is
        reused by forward, backward and, without documents, every step)."""
        if max_entries not in self._calls:
            self._calls[max_entries] = [
                self._call(rows[i : i + step], cols[i : i + step])
                for rows, cols in self.groups
                for step in (max(1, max_entries // (self.block_size**2 * cols.shape[1])),)
                for i in range(0, rows.shape[0], step)
            ]
        return self._calls[max_entries]

    def _call(self, rows: torch.Tensor, cols: torch.Tensor) -> BlockCall:
        r, c = cols.shape
        r0, c0 = int(rows[0]), int(cols[0, 0])
        ar = torch.arange(max(r, c), device=rows.device)
        row_start = r0 if torch.equal(rows, r0 + ar[:r]) else None
        band_start = c0 if torch.equal(cols, c0 + ar[:r, None] + ar[:c]) else None
        mask, per_row = None, False
        if self.full is None or not bool(self.full[rows[:, None], cols].all()):
            mask = self.group_mask(rows, cols)  # [R, B, c * B]
            if bool((mask == mask[:1]).all()):
                mask = mask[:1].clone()
            else:
                mask, per_row = None, True  # recomputed at each call: bounded memory
        return BlockCall(rows, cols, row_start, band_start, mask, per_row)

    def call_mask(self, call: BlockCall) -> torch.Tensor | None:
        """The entry mask of ``call``: bool # [R or 1, B, c * B], or None (all allowed)."""
        return self.group_mask(call.rows, call.cols) if call.per_row else call.mask

    def allowed(self, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        """bool, broadcast of ``qi`` and ``ki`` (padded local indices): the entry is allowed."""
        return _token_allowed(self, self.q_pos[qi], self.k_pos[ki], qi, ki)

    def group_mask(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """bool # [R, B, c * B]: entries of query blocks ``rows`` against key blocks ``cols``."""
        b = self.block_size
        ar = torch.arange(b, device=rows.device)
        qi = (rows[:, None] * b + ar).unsqueeze(-1)  # [R, B, 1]
        ki = (cols[:, :, None] * b + ar).reshape(rows.shape[0], 1, -1)  # [R, 1, c * B]
        return self.allowed(qi, ki)


def _token_allowed(plan: BlockPlan, qp, kp, qi, ki) -> torch.Tensor:
    ok = (qp >= 0) & (kp >= 0)
    lo, hi = plan.spec.band
    d = kp - qp
    if lo > -float("inf"):
        ok = ok & (d >= lo)
    if hi < float("inf"):
        ok = ok & (d <= hi)
    if plan.q_doc is not None:
        ok = ok & (plan.q_doc[qi] == plan.k_doc[ki])
    if plan._layout is not None:
        lb = plan.spec.layout_block
        ok = ok & plan._layout[qp.clamp(min=0) // lb, kp.clamp(min=0) // lb]
    return ok


def pad_end(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """``x`` # [m] extended to # [n] with ``fill`` (positions and documents to whole blocks)."""
    return torch.cat((x, x.new_full((n - x.shape[0],), fill)))


def _ranges(x: torch.Tensor, nb: int, b: int, valid: torch.Tensor) -> tuple:
    """Per block: (min, max) of ``x`` over its valid entries # [nb] each."""
    big = torch.iinfo(torch.int64).max
    v = x.view(nb, b)
    ok = valid.view(nb, b)
    return v.masked_fill(~ok, big).amin(1), v.masked_fill(~ok, -big).amax(1)


def _band(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc) -> int | None:
    """L when the mask is a causal window of L >= 1 keys back and nothing else, over positions
    0 .. s-1 for queries and keys alike; None otherwise."""
    if not spec.causal or spec.window is None or spec.window[0] < 1:
        return None
    if spec.layout is not None or q_doc is not None or q_pos.shape != k_pos.shape:
        return None
    whole = torch.arange(q_pos.shape[0], device=q_pos.device)
    return spec.window[0] if torch.equal(q_pos, whole) and torch.equal(k_pos, whole) else None


def build_block_plan(
    spec: MaskSpec,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    block_size: int,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> BlockPlan:
    """The block plan of one sample. ``q_pos`` # [sq], ``k_pos`` # [sk]: positions in the whole
    sequence (int64, non-negative); ``q_doc``/``k_doc``: document ids of the same tokens (both or
    neither)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together")
    b, sq, sk = block_size, q_pos.shape[0], k_pos.shape[0]
    nq, nk = -(-sq // b), -(-sk // b)
    qp, kp = pad_end(q_pos.long(), nq * b, -1), pad_end(k_pos.long(), nk * b, -1)
    qd = kd = None
    if q_doc is not None:
        qd, kd = pad_end(q_doc.long(), nq * b, -1), pad_end(k_doc.long(), nk * b, -2)
    layout = None
    if spec.layout is not None:
        span = int(max(q_pos.max(), k_pos.max())) + 1
        layout = spec.layout(-(-span // spec.layout_block)).to(q_pos.device)
    plan = BlockPlan(b, sq, sk, spec, qp, kp, qd, kd, None, [], layout)  # type: ignore[arg-type]

    qv, kv = qp >= 0, kp >= 0
    qmin, qmax = _ranges(qp, nq, b, qv)
    kmin, kmax = _ranges(kp, nk, b, kv)
    lo, hi = spec.band
    dmin = kmin[None, :] - qmax[:, None]  # [nq, nk]: the range of k - q in the block
    dmax = kmax[None, :] - qmin[:, None]
    may = (dmax >= lo) & (dmin <= hi)
    sure = (dmin >= lo) & (dmax <= hi)
    if qd is not None:
        qdmin, qdmax = _ranges(qd, nq, b, qv)
        kdmin, kdmax = _ranges(kd, nk, b, kv)
        may &= (qdmax[:, None] >= kdmin[None, :]) & (qdmin[:, None] <= kdmax[None, :])
        sure &= (qdmin == qdmax)[:, None] & (kdmin == kdmax)[None, :]
        sure &= qdmin[:, None] == kdmin[None, :]
    if layout is not None:
        lb = spec.layout_block
        qlo, qhi, klo, khi = qmin // lb, qmax // lb, kmin // lb, kmax // lb
        if bool((qlo == qhi).all() and (klo == khi).all()):  # each block in one layout block
            hit = layout[qlo][:, klo]
            may &= hit
            sure &= hit
        else:
            sure &= False
    blocks = sure.clone()
    # a block with padding is never full: padded keys must stay hidden
    plan.full = sure & (qp >= 0).view(nq, b).all(1)[:, None] & (kp >= 0).view(nk, b).all(1)
    plan.band = _band(spec, q_pos, k_pos, q_doc)
    unsure = (may & ~sure).nonzero()  # [u, 2]
    ar = torch.arange(b, device=q_pos.device)
    step = max(1, _CHECK_ENTRIES // (b * b))
    for start in range(0, unsure.shape[0], step):
        ij = unsure[start : start + step]
        qi = (ij[:, 0:1] * b + ar).unsqueeze(-1)  # [u, B, 1]
        ki = (ij[:, 1:2] * b + ar).unsqueeze(1)  # [u, 1, B]
        hit = plan.allowed(qi, ki).flatten(1).any(1)
        blocks[ij[hit, 0], ij[hit, 1]] = True
    plan.blocks = blocks
    counts = blocks.sum(1)
    for c in counts.unique().tolist():
        if c == 0:
            continue
        rows = (counts == c).nonzero().flatten()
        cols = blocks[rows].nonzero()[:, 1].view(rows.shape[0], c)
        plan.groups.append((rows, cols))
    return plan
