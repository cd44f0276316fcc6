"""Causal sliding-window attention by tiles: the fast path of a plain window.

Window L (Megatron's ``window_size`` (L, 0), causal): query q reads keys ``q - L <= k <= q``. Cut
the sequence into tiles of T tokens, T dividing L (L = m T). The query at offset a of tile i reads

    tile i            keys at offsets b <= a      causal: the kernel's own mask
    tiles i-1..i-m+1  every key                   q - k <= L - 1: inside the window
    tile i-m          keys at offsets b >= a      k >= q - L  <=>  (i-m)T + b >= iT + a - L

So the window is m + 1 calls of the block kernel (``block_attention``), each batched over all
tiles: causal on the tiles as they lie, unmasked on the tiles j = 1 .. m-1 back, and with one
shared T x T mask (b >= a) on the tile m back; their (out, lse) merge exactly, in place
(``merge_into``). The tiles are the kernel's batch dim, tile-major (# [nt, b * n, T, d]): the
calls take the tiles j.. and ..nt-1-j as slices. The backward kernel reads the output grad
sequence-major (its own layout, # [nt, T, b * n, d] in memory) and copies any other layout in
every call, so the output grad is copied into that layout once: every tile slice of it is then
the kernel's layout already.
Every query reads exactly its L + 1 keys; the kernel computes L + T per query (it does not skip
inside one causal tile). Keys are plain slices of the tiled sequence, so each call's grads are the
size of its inputs: no key block is gathered once per query block that reads it.

T is the largest divisor of L that leaves at least ``MIN_TILE`` queries per tile (L itself when
none does): torch's CPU flash kernel cuts 192 queries or more into 64-row tiles, fewer into 32-row
tiles, which cost about twice as much per score entry.

A sequence that is not a multiple of T is padded at its end: padded keys come after every real
query of the last tile (causality hides them), padded queries are dropped and carry no grad.
"""

from __future__ import annotations

import torch

from megalite.core.attention.block_attention import block_backward, block_forward, merge_into

MIN_TILE = 256  # queries per tile where the window allows it (the CPU kernel's wider tiles)


def band_tile(window: int) -> int:
    """The tile length T for a window of ``window`` keys back: the largest divisor of the window
    of at least ``MIN_TILE``, else the window itself."""
    parts = max(1, window // MIN_TILE)
    while window % parts:
        parts -= 1
    return window // parts


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """# [b, n, s, ...] -> [nt, b * n, tile, ...] (zero-padded at the end of s; a view of x's
    storage when tile divides s)."""
    b, n, s = x.shape[:3]
    nt = -(-s // tile)
    x = x.reshape(b * n, s, *x.shape[3:])
    if nt * tile != s:
        x = torch.cat((x, x.new_zeros(b * n, nt * tile - s, *x.shape[2:])), dim=1)
    return x.view(b * n, nt, tile, *x.shape[2:]).transpose(0, 1)


def _untile(x: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """The inverse of ``_tiles``: # [nt, b * n, tile, ...] -> [b, n, s, ...]."""
    x = x.transpose(0, 1)
    return x.reshape(b, -1, x.shape[1] * x.shape[2], *x.shape[3:])[:, :, :s]


def _upper(tile: int, device) -> torch.Tensor:
    """bool # [T, T]: key offset b >= query offset a (the tile m back)."""
    return torch.ones(tile, tile, dtype=torch.bool, device=device).triu()


def _offsets(window: int, tile: int, num_tiles: int) -> list[tuple[int, bool]]:
    """(j, last) for each tile offset j >= 1 back that some query reads; ``last``: j = m, the
    tile read only from the query's own offset on (b >= a)."""
    m = window // tile
    return [(j, j == m) for j in range(1, min(m, num_tiles - 1) + 1)]


def band_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q # [b, n, s, d] over k, v (same shape, heads expanded) within a window
    of ``window`` keys back (>= 1). Returns (out # [b, n, s, d] fp32, lse # [b, n, s] fp32)."""
    b, s = q.shape[0], q.shape[2]
    tile = band_tile(window)
    qt, kt, vt = (_tiles(x, tile) for x in (q, k, v))  # [nt, BH, T, d]
    out, lse = block_forward(qt, kt, vt, causal=True, scale=scale)  # each tile's own keys
    out = out.float()
    for j, last in _offsets(window, tile, qt.shape[0]):
        rows, keys = slice(j, None), slice(None, -j)  # tiles j.. read tiles ..nt-1-j
        mask = _upper(tile, q.device) if last else None
        o, o_lse = block_forward(qt[rows], kt[keys], vt[keys], causal=False, scale=scale, mask=mask)
        merge_into(out[rows], lse[rows], o, o_lse)
    return _untile(out, b, s), _untile(lse, b, s)


def band_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) fp32 of ``band_forward``, given its ``out`` and ``lse`` and ``dout``."""
    b, s = q.shape[0], q.shape[2]
    tile = band_tile(window)
    tiled = [_tiles(x, tile) for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype), lse)]
    # the kernel's layout: [nt, b * n, T, d] viewing [nt, T, b * n, d] memory (no copy per call)
    tiled[0] = tiled[0].transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv = (g.float() for g in block_backward(*tiled, causal=True, scale=scale))
    do, qt, kt, vt, ot, lt = tiled
    for j, last in _offsets(window, tile, qt.shape[0]):
        rows, keys = slice(j, None), slice(None, -j)
        args = [do[rows], qt[rows], kt[keys], vt[keys], ot[rows], lt[rows]]
        mask = _upper(tile, q.device) if last else None
        grads = block_backward(*args, causal=False, scale=scale, mask=mask)
        dq[rows] += grads[0]
        dk[keys] += grads[1]
        dv[keys] += grads[2]
    return _untile(dq, b, s), _untile(dk, b, s), _untile(dv, b, s)


def band_blocks(window: int, s: int, block_size: int) -> torch.Tensor:
    """bool # [nb, nb]: the blocks of ``block_size`` tokens in which the calls compute some entry,
    from the tiles' geometry (own tile: b <= a; j < m back: all; m back: b >= a)."""
    tile = band_tile(window)
    m = window // tile
    pos = torch.arange(s)
    t, off = pos // tile, pos % tile
    back = t[:, None] - t[None, :]  # [s, s] tiles between query and key
    entries = ((back == 0) & (off[None, :] <= off[:, None])) | ((back > 0) & (back < m))
    entries |= (back == m) & (off[None, :] >= off[:, None])
    nb = -(-s // block_size)
    padded = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    padded[:s, :s] = entries
    return padded.view(nb, block_size, nb, block_size).any(3).any(1)
