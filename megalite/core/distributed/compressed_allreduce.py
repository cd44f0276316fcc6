"""The 1-bit compressed all-reduce (1-bit Adam's): the mean over a group of one flat fp32 tensor
per rank, each value sent as its sign plus one fp32 scale per block of ``block`` values (default
``SCALE_BLOCK``), with error feedback on the sending worker and on the reducing server.

    car = CompressedAllReduce(numel, dp_group)      # error buffers live here, one per rank
    mean = car(x)                                   # x: [numel] fp32 -> [numel] fp32, same on all

The tensor is cut into ``n = group size`` chunks of ``chunk`` elements (``ceil(numel / n)``
rounded up to a multiple of 8, so a chunk packs into whole bytes); chunk ``j`` holds elements
``[j * chunk, min((j + 1) * chunk, numel))``, the last ones may be short or empty (their tail is
padding that is never sent as data: it is zero, carries no error, and enters no scale).
Rank ``j`` is the *server* of chunk ``j``. One call:

1. worker: ``c = x + e_w``; each chunk is cut in blocks of ``block`` values (the last one short),
   per block ``scale = ||c_b|| / sqrt(len_b)`` over its real values (0 when empty), the
   compressed value ``scale * sign(c_b)`` (sign of 0 is +1), and the new worker error
   ``e_w = c - compressed``;
2. all-to-all: chunk ``j``'s sign bits (packed 8 per uint8) and its block scales (4 bytes each)
   go to rank j;
3. server ``r``: decompress the ``n`` received copies of chunk ``r``, average them, add the server
   error ``e_s``, compress again the same way, ``e_s = s - compressed``;
4. all-gather of every server's packed chunk and scales; every rank decompresses the whole tensor.

Why blocks: one scale for a whole chunk gives every value of it the chunk's root-mean-square
magnitude, so the rows of an embedding that a step barely touched (tiny momentum, tiny variance)
receive the magnitude of the busiest weights, divided by their tiny variance: 1-bit Adam's loss
trailed Adam's by 9% after 300 steps on the bench's small GPT (``tools/bench/bench_onebit.py``).
Scales per 1,024 values cost 4 bytes per 128 sign bytes (3%).

Bytes (``measure.comm_log.CommLog``'s convention): one all-to-all of ``n * (chunk / 8 + 4 k)``
uint8 (``k`` blocks per chunk) and one all-gather of the same size (``wire_bytes``), against
``4 * numel`` for an fp32 all-reduce; on the wire (``planning.cluster.bus_factor``) the
all-reduce moves twice its tensor.
On a group of one nothing is sent and the result is the doubly compressed value (the same
arithmetic, so a single-process run is the same algorithm).

``compress`` / ``decompress`` and ``reference_allreduce`` (the whole algorithm over a list of the
ranks' tensors in one process) are the definition the tests hold the collective to.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite.core.groups import all_gather_tensor, group_rank, group_size

SCALE_BYTES = 4  # one fp32 scale per block, sent as 4 uint8 after the chunk's sign bytes
SCALE_BLOCK = 1024  # values per scale (module docstring: why blocks)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def chunk_numel(numel: int, n: int) -> int:
    """Elements per chunk: ``ceil(numel / n)`` rounded up to a multiple of 8."""
    return max(8, 8 * math.ceil(math.ceil(numel / n) / 8))


def chunk_lengths(numel: int, n: int) -> list[int]:
    """The real (unpadded) length of each of the ``n`` chunks."""
    size = chunk_numel(numel, n)
    return [max(0, min(size, numel - j * size)) for j in range(n)]


def scale_blocks(chunk: int, block: int = SCALE_BLOCK) -> int:
    """Scales per chunk: ``ceil(chunk / block)``."""
    return math.ceil(chunk / block)


def wire_bytes(numel: int, n: int, block: int = SCALE_BLOCK) -> int:
    """Bytes of one call as ``CommLog`` counts them (all-to-all input + all-gather output); 0 on a
    group of one."""
    if n == 1:
        return 0
    chunk = chunk_numel(numel, n)
    return 2 * n * (chunk // 8 + SCALE_BYTES * scale_blocks(chunk, block))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` (k a multiple of 8) -> ``[..., k / 8]`` uint8: bit i of byte b is
    ``x[..., 8 b + i] >= 0``."""
    bits = (x >= 0).to(torch.uint8).reshape(*x.shape[:-1], -1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_signs`` as fp32 +1 / -1: ``[..., k / 8]`` -> ``[..., k]``."""
    bits = torch.bitwise_and(packed.unsqueeze(-1), _BIT_WEIGHTS.to(packed.device)) > 0
    return (bits.to(torch.float32) * 2 - 1).reshape(*packed.shape[:-1], -1)


def _blocks(c: torch.Tensor, block: int) -> torch.Tensor:
    """``[m, chunk]`` -> ``[m, k, block]``, zero-padded to whole blocks."""
    k = scale_blocks(c.shape[1], block)
    return torch.nn.functional.pad(c, (0, k * block - c.shape[1])).view(c.shape[0], k, block)


def compress(
    c: torch.Tensor, lengths: list[int], block: int = SCALE_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``c``: ``[m, chunk]`` fp32 with zero padding past ``lengths[j]`` in row ``j`` ->
    (packed signs ``[m, chunk / 8]`` uint8, scales ``[m, k]`` fp32: ``||c_b|| / sqrt(len_b)``
    per block ``b`` of ``block`` values, ``len_b`` its real values)."""
    k = scale_blocks(c.shape[1], block)
    starts = torch.arange(k, device=c.device) * block
    length = torch.tensor(lengths, device=c.device).unsqueeze(1)  # [m, 1]
    real = (length - starts).clamp(1, block).to(torch.float32)  # [m, k]; empty: 1, norm 0
    scales = torch.linalg.vector_norm(_blocks(c, block), dim=2) / real.sqrt()
    return pack_signs(c), scales


def decompress(
    packed: torch.Tensor, scales: torch.Tensor, lengths: list[int], block: int = SCALE_BLOCK
) -> torch.Tensor:
    """``scale_b * sign`` per block of each row, zero past ``lengths[j]``: ``[m, chunk]`` fp32."""
    signs = unpack_signs(packed)
    chunk = signs.shape[1]
    values = (_blocks(signs, block) * scales.unsqueeze(2)).view(signs.shape[0], -1)[:, :chunk]
    return values * _mask(lengths, chunk, values.device)


def _mask(lengths: list[int], chunk: int, device) -> torch.Tensor:
    cols = torch.arange(chunk, device=device)
    return (cols < torch.tensor(lengths, device=device).unsqueeze(1)).to(torch.float32)


def _to_bytes(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of ``[signs, 4 bytes per scale]``: one uint8 message per chunk."""
    return torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=1)


def _from_bytes(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``_to_bytes`` for ``k`` scales per row."""
    packed, scale_bytes = rows[:, : -SCALE_BYTES * k], rows[:, -SCALE_BYTES * k :]
    return packed, scale_bytes.reshape(-1).clone().view(torch.float32).view(rows.shape[0], k)


class CompressedAllReduce:
    """The collective with this rank's error-feedback state (module docstring).

    ``worker_error``: ``[numel]`` fp32; ``server_error``: ``[chunk]`` fp32 (this rank's chunk,
    zero past its real length). Both start at zero; ``state_dict`` / ``load_state_dict`` carry
    them (they belong to one group size: a checkpoint from another size cannot be loaded)."""

    def __init__(
        self, numel: int, group, *, device: torch.device | str = "cpu", block: int = SCALE_BLOCK
    ):
        self.numel, self.group, self.block = numel, group, block
        self.n, self.rank = group_size(group), group_rank(group)
        self.chunk = chunk_numel(numel, self.n)
        self.lengths = chunk_lengths(numel, self.n)
        self.k = scale_blocks(self.chunk, block)
        self.worker_error = torch.zeros(numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)

    def state_dict(self) -> dict:
        return {
            "group_size": self.n,
            "worker_error": self.worker_error.clone(),
            "server_error": self.server_error.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["group_size"] != self.n or state["worker_error"].numel() != self.numel:
            raise ValueError(
                f"error-feedback state of group size {state['group_size']} and "
                f"{state['worker_error'].numel()} elements does not fit group size {self.n} and "
                f"{self.numel} elements"
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def reset(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, chunk, lengths, block, k = self.n, self.chunk, self.lengths, self.block, self.k
        # worker: compress x + e_w chunk by chunk, keep what compression lost
        c = torch.zeros(n * chunk, dtype=torch.float32, device=x.device)
        c[: self.numel] = x.reshape(-1).float() + self.worker_error
        c = c.view(n, chunk)  # [n, chunk]
        packed, scales = compress(c, lengths, block)
        lost = c - decompress(packed, scales, lengths, block)
        self.worker_error.copy_(lost.reshape(-1)[: self.numel])
        # all-to-all: row j (chunk j's signs and scale) to its server, rank j
        send = _to_bytes(packed, scales)  # [n, chunk/8 + 4 k] uint8
        recv = torch.empty_like(send)
        if n > 1:
            dist.all_to_all_single(recv, send, group=self.group)
        else:
            recv.copy_(send)
        # server: average the n copies of my chunk, add e_s, compress again
        mine = [lengths[self.rank]]
        got_packed, got_scales = _from_bytes(recv, k)  # every worker's copy of chunk `rank`
        copies = decompress(got_packed, got_scales, mine * n, block)
        s = copies.mean(0, keepdim=True) + self.server_error.unsqueeze(0)  # [1, chunk]
        s_packed, s_scale = compress(s, mine, block)
        self.server_error.copy_((s - decompress(s_packed, s_scale, mine, block)).reshape(-1))
        # all-gather every server's chunk; decompress the whole tensor
        out_rows = torch.empty_like(send)  # [n, chunk/8 + 4 k] uint8
        if n > 1:
            all_gather_tensor(
                out_rows.view(-1), _to_bytes(s_packed, s_scale).reshape(-1), self.group
            )
        else:
            out_rows.copy_(_to_bytes(s_packed, s_scale))
        all_packed, all_scales = _from_bytes(out_rows, k)
        return decompress(all_packed, all_scales, lengths, block).reshape(-1)[: self.numel]


def _reference_quantise(part: torch.Tensor, block: int) -> torch.Tensor:
    """``part`` (a chunk's real values) as scale times sign, one scale per block of ``block``."""
    out = []
    for lo in range(0, part.numel(), block):
        b = part[lo : lo + block]
        out.append(b.norm() / math.sqrt(b.numel()) * torch.where(b >= 0, 1.0, -1.0))
    return torch.cat(out) if out else part.clone()


def reference_allreduce(
    xs: list[torch.Tensor],
    worker_errors: list[torch.Tensor],
    server_errors: list[torch.Tensor],
    block: int = SCALE_BLOCK,
) -> torch.Tensor:
    """The collective's definition in one process, written element-wise per chunk and block
    without the packing: ``xs[i]`` / ``worker_errors[i]`` are rank i's input and worker error
    (``[numel]``), ``server_errors[j]`` rank j's server error (``[chunk]``, zero past the real
    length); the errors are updated in place; returns the mean every rank receives."""
    n, numel = len(xs), xs[0].numel()
    chunk, lengths = chunk_numel(numel, n), chunk_lengths(numel, n)
    sent = []  # sent[i][j]: rank i's decompressed chunk j (real length)
    for i in range(n):
        c = xs[i] + worker_errors[i]
        rows = [_reference_quantise(c[j * chunk : j * chunk + lengths[j]], block) for j in range(n)]
        worker_errors[i].copy_(c - torch.cat(rows))
        sent.append(rows)
    result = []
    for j in range(n):
        k = lengths[j]
        s = torch.stack([sent[i][j] for i in range(n)]).mean(0) + server_errors[j][:k]
        q = _reference_quantise(s, block)
        server_errors[j][:k] = s - q
        result.append(q)
    return torch.cat(result)
