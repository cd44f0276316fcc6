"""Causal sliding-window attention by tiles: the fast path of a plain window.

Window L (Megatron's ``window_size`` (L, 0), causal): query q reads keys ``q - L <= k <= q``. The
sequence is a head (positions 0 .. H - 1) and tiles of T tokens (T <= L) that end with it (H = s -
nt T, L <= H < L + T when nt >= 1: no padding). The query at offset a of the tile that starts at
p reads L + 1 keys, which three calls of the block kernel (``block_attention``) cover exactly:

    own    keys p .. p + T - 1          offsets b <= a       causal: the kernel's own mask
    full   keys p - L + T .. p - 1      every key            k >= p + T - L > q - L
    back   keys p - L .. p - L + T - 1  offsets b >= a       one shared T x T mask

Each call is batched over the tiles (the kernel's batch dim, # [nt, b * n, T, d]); the keys are
strided views of the sequence that start 0, L - T and L keys before the tile (overlapping from
tile to tile where L - T > T: no copy). Their (out, lse) merge exactly, in place (``merge_into``).
The head is one causal call with the window's lower bound as a mask (its queries have fewer than
L keys before them).

The kernel computes whole tiles: L + T keys per query for the L + 1 it keeps (the own tile above
its diagonal and the back tile below its own). So T is the smallest tile the kernel runs
efficiently, ``MIN_TILE``: torch's CPU flash kernel cuts 192 queries or more into 64-row blocks,
fewer into 32-row blocks, which cost about 1.3x as much per score entry (fp32, one thread). A
window shorter than that is one tile (T = L).

Backward accumulates the grads sequence-major (# [s, b * n, d]), the layout the kernel returns its
grads in, so every add is a contiguous run of whole key rows; the key grads of a strided view go
back by slices of at most T keys (which do not overlap from tile to tile). Grads are the size of
the inputs: no key is gathered once per query that reads it. The grads are returned as views of
that layout (# [b, n, s, d], not contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.core.attention.block_attention import block_backward, block_forward, merge_into

MIN_TILE = 192  # queries per call from which the CPU kernel uses its 64-row blocks


def band_tile(window: int) -> int:
    """The tile length T for a window of ``window`` keys back: ``MIN_TILE``, or the window itself
    when it is shorter (a tile may not reach past the window)."""
    return min(window, MIN_TILE)


@dataclass(frozen=True)
class _Band:
    """A window ``window`` over ``s`` positions: the head 0 .. ``head`` - 1, then ``num_tiles``
    tiles of ``tile`` tokens."""

    window: int
    tile: int
    head: int
    num_tiles: int

    @classmethod
    def of(cls, window: int, s: int) -> _Band:
        tile = band_tile(window)
        nt = max(0, (s - window) // tile)  # a tile's back keys start L before it, at >= 0
        return cls(window, tile, s - nt * tile, nt)

    def regions(self) -> list[tuple[int, int, bool]]:
        """(start relative to the tile, keys, upper) of the full and back calls; ``upper``: the
        back call's mask, key offset b >= query offset a."""
        full = self.window - self.tile
        back = [(-self.window, self.tile, True)]
        return ([(-full, full, False)] if full > 0 else []) + back

    def head_mask(self, device) -> torch.Tensor | None:
        """bool # [H, H]: k >= q - L over the head (causality is the kernel's); None where it
        allows every entry."""
        if self.window >= self.head - 1:
            return None
        pos = torch.arange(self.head, device=device)
        return pos[None, :] >= pos[:, None] - self.window


def _tiles(x: torch.Tensor, band: _Band, start: int = 0, length: int = 0) -> torch.Tensor:
    """Rows ``p + start`` .. ``p + start + length - 1`` (default: the tile) of each tile at p, from
    x # [BH, s, ...] contiguous -> # [nt, BH, length, ...]: a strided view, overlapping from tile
    to tile where length > T."""
    bh, s, inner = x.shape[0], x.shape[1], x[0, 0].numel()
    size = (band.num_tiles, bh, length or band.tile, *x.shape[2:])
    stride = (band.tile * inner, s * inner, *x[0].stride())
    return x.as_strided(size, stride, x.storage_offset() + (band.head + start) * inner)


def _seq_tiles(acc: torch.Tensor, band: _Band, start: int, length: int) -> torch.Tensor:
    """The same rows as ``_tiles`` from a sequence-major acc # [s, BH, d] (its logical view
    # [nt, BH, length, d])."""
    s, bh, d = acc.shape
    size = (band.num_tiles, bh, length, d)
    offset = acc.storage_offset() + (band.head + start) * bh * d
    return acc.as_strided(size, (band.tile * bh * d, d, bh * d, 1), offset)


def _upper(tile: int, device) -> torch.Tensor:
    """bool # [T, T]: key offset b >= query offset a (the back call)."""
    return torch.ones(tile, tile, dtype=torch.bool, device=device).triu()


def _flat(x: torch.Tensor) -> torch.Tensor:
    """# [b, n, s, ...] -> [b * n, s, ...] contiguous (a view where x is)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def band_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q # [b, n, s, d] over k, v (same shape, heads expanded) within a window
    of ``window`` keys back (>= 1). Returns (out # [b, n, s, d] fp32, lse # [b, n, s] fp32)."""
    b, n, s, d = q.shape
    band = _Band.of(window, s)
    q3, k3, v3 = (_flat(x) for x in (q, k, v))  # [BH, s, d]
    out = torch.empty(q3.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device)
    h = band.head
    head = (x[None, :, :h] for x in (q3, k3, v3))
    o, o_lse = block_forward(*head, causal=True, scale=scale, mask=band.head_mask(q.device))
    out[:, :h], lse[:, :h] = o[0], o_lse[0]
    if band.num_tiles:
        qt = _tiles(q3, band)  # [nt, BH, T, d]
        o, o_lse = block_forward(qt, _tiles(k3, band), _tiles(v3, band), causal=True, scale=scale)
        o = o.float()
        for start, length, upper in band.regions():
            kt, vt = _tiles(k3, band, start, length), _tiles(v3, band, start, length)
            mask = _upper(band.tile, q.device) if upper else None
            merge_into(o, o_lse, *block_forward(qt, kt, vt, causal=False, scale=scale, mask=mask))
        _tiles(out, band).copy_(o)
        _tiles(lse, band).copy_(o_lse)
    return out.view(b, n, s, d), lse.view(b, n, s)


def _add_keys(acc: torch.Tensor, band: _Band, start: int, grad: torch.Tensor) -> None:
    """``acc`` # [s, BH, d] += a strided key view's grad # [nt, BH, length, d], by slices of at
    most T keys (each slice's tiles do not overlap, so it adds in place)."""
    for lo in range(0, grad.shape[2], band.tile):
        part = grad[:, :, lo : lo + band.tile]
        _seq_tiles(acc, band, start + lo, part.shape[2]).add_(part)


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
    b, n, s, d = q.shape
    band = _Band.of(window, s)
    # [BH, s, d] each; q, k, v and out contiguous (the key views need it), the output grad not
    q3, k3, v3, o3 = (_flat(x.to(q.dtype)) for x in (q, k, v, out))
    do3 = dout.to(q.dtype).reshape(q3.shape)  # any strides (autograd's may be 0): views only
    l3 = _flat(lse)  # [BH, s]
    grads = [torch.empty(s, b * n, d, dtype=torch.float32, device=q.device) for _ in range(3)]
    h = band.head
    head = (x[None, :, :h] for x in (do3, q3, k3, v3, o3, l3))
    mask = band.head_mask(q.device)
    for acc, g in zip(grads, block_backward(*head, causal=True, scale=scale, mask=mask)):
        acc[:h] = g[0].transpose(0, 1)  # [h, BH, d]
    if band.num_tiles:
        qt, ot, lt = (_tiles(x, band) for x in (q3, o3, l3))
        # the kernel's backward takes it contiguous: made so once, for the three calls
        dot = do3[:, h:].unflatten(1, (band.num_tiles, band.tile)).transpose(0, 1).contiguous()
        kt, vt = _tiles(k3, band), _tiles(v3, band)
        own = block_backward(dot, qt, kt, vt, ot, lt, causal=True, scale=scale)
        for acc, g in zip(grads, own):  # the tiles' own rows: the first grads written there
            _seq_tiles(acc, band, 0, band.tile).copy_(g)
        dq = _seq_tiles(grads[0], band, 0, band.tile)
        for start, length, upper in band.regions():
            kt, vt = _tiles(k3, band, start, length), _tiles(v3, band, start, length)
            mask = _upper(band.tile, q.device) if upper else None
            args = (dot, qt, kt, vt, ot, lt)
            gq, gk, gv = block_backward(*args, causal=False, scale=scale, mask=mask)
            dq.add_(gq)
            _add_keys(grads[1], band, start, gk)
            _add_keys(grads[2], band, start, gv)
    dq, dk, dv = (g.view(s, b, n, d).permute(1, 2, 0, 3) for g in grads)
    return dq, dk, dv


def band_blocks(window: int, s: int, block_size: int) -> torch.Tensor:
    """bool # [nb, nb]: the blocks of ``block_size`` tokens in which the calls let some entry
    through, from the calls' geometry (head: causal with k >= q - L; a tile's own keys: b <= a;
    its full keys: all; its back keys: b >= a)."""
    band = _Band.of(window, s)
    t, lw, h = band.tile, window, band.head
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    start = (q - h) // t * t + h  # the query's tile (past the head)
    entries = (q < h) & (k <= q) & (k >= q - lw)
    own = (k >= start) & (k <= q)
    full = (k >= start - lw + t) & (k < start)
    back = (k >= start - lw) & (k < start - lw + t) & (k - (start - lw) >= q - start)
    entries |= (q >= h) & (own | full | back)
    nb = -(-s // block_size)
    padded = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    padded[:s, :s] = entries
    return padded.view(nb, block_size, nb, block_size).any(3).any(1)
