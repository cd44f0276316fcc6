"""The time offloaded state's transfers add to a step: host <-> device copies (PCIe) and NVMe
reads and writes, per pipeline rank, from the bytes each offload moves (ZeRO-Infinity's ladder).

    transfers = offload_transfers(c, layout, pp_rank=0, m=8, precision="bf16", grads_in_fp32=True)
    exposed, seconds = offload_seconds(transfers, cluster, busy=...)

Per step on one rank, with ``N`` the rank's shard of the sharded state (its parameters over the
DP group), ``f`` the offloaded share of the optimizer state, ``m`` micro-batches, ``p`` / ``g``
the params' and grads' bytes per element (the code each line follows in brackets):

    params (ZeRO-3 offload)  each unit's shard read at each gather: ``2 m`` per unit (``3 m`` for
                             a tied embedding that also serves the output layer): host -> device
                             [``ParamStore.read_into``, before the unit's all-gather]; from files:
                             an NVMe read and the staging copy to the device, on the reader thread
                             one unit ahead (overlapped) [``ParamStore.prefetch``]
    grads                    ZeRO-3 with the whole optimizer offloaded: each micro-batch's reduced
                             shard to the host, ``m N g`` [``Zero3DataParallel._add_shard``];
                             else the offloaded pieces' fp32 grads to the host once, ``4 f N``
                             [``_before_inner_step``, the NVMe step's ``load``]
    optimizer                in files: master and both Adam moments read and written, ``12 f N``
                             each way [``NvmeStore.load`` / ``save``]; then the updated params
                             back, ``f N p``: to the device, or to the param files (an fp32 param
                             file is the master file itself: nothing more), or nothing when the
                             params live on the host [``ShardState.copy_to_params``]; the params
                             on the host with the optimizer on the device: ``N p`` to the host
    activations              ``--cpu-offloading N``: the first N layers' saved bytes of each chunk
                             (a recomputed layer's checkpointed input) to the host in forward and
                             back in backward, ``2 m`` per step [``ActivationOffload``]: on a GPU
                             a side stream (overlapped), on a CPU a copy in line

Links (``Cluster.offload_seconds``): ``host`` at ``host_gbps`` (free on a CPU "device", whose host
memory is its memory, unless calibrated: then the memcpy's figure), NVMe reads at
``disk_read_gbps``, writes at ``disk_write_gbps``. Transfers marked overlapped hide behind the
rank's compute up to its length; the others add in full. Shards are counted unpadded (``N`` is
each parameter's elements over the DP size; the padded buffer differs by < DP elements a bucket).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megalite.models.config import GPTConfig
from megalite.planning.cluster import Cluster, exposed_seconds
from megalite.planning.model_state import DTYPE_BYTES, ParamSpec
from megalite.planning.predict import Layout, layout_params


@dataclass(frozen=True)
class Transfer:
    """Bytes one rank moves per step for one piece of state over one link."""

    what: str  # params | grads | optimizer | activations
    link: str  # host | disk_read | disk_write (Cluster.offload_seconds)
    nbytes: float
    overlapped: bool = False  # hidden behind the rank's compute, up to its length


def _shard_elements(specs: list[ParamSpec], layout: Layout, units: bool = False):
    """The rank's shard elements (dense over dp x cp, experts over edp); ``units``: per ZeRO-3
    unit as a Counter."""
    out: Counter = Counter()
    for p in specs:
        out[p.unit] += p.numel / (layout.edp if p.expert else layout.dp * layout.cp)
    return out if units else sum(out.values())


def offload_transfers(
    c: GPTConfig,
    layout: Layout,
    *,
    pp_rank: int,
    m: int,
    precision: str,
    grads_in_fp32: bool | None = None,
    activation_bytes: tuple[int, int] = (0, 0),
    tied_unit: int | None = None,
) -> list[Transfer]:
    """What pipeline rank ``pp_rank`` moves per step of ``m`` micro-batches (module docstring).
    ``activation_bytes``: (one layer's saved bytes, a chunk's input bytes) for
    ``--cpu-offloading``; ``tied_unit``: the ZeRO-3 unit gathered once more for a tied output
    layer on this rank (``traffic.tied_embedding_unit``)."""
    p = DTYPE_BYTES[precision]
    if grads_in_fp32 is None:
        grads_in_fp32 = precision == "bf16"
    g = 4 if grads_in_fp32 else p
    zero3 = layout.rung == "optim_grads_params"
    specs = layout_params(c, layout, pp_rank)
    n = _shard_elements(specs, layout)
    f = layout.offload_fraction if layout.rung != "no_shard" else 0.0
    params = layout.param_offload if zero3 else "device"
    out: list[Transfer] = []
    if params != "device":
        units = _shard_elements(specs, layout, units=True)
        reads = sum((3 if u == tied_unit else 2) * m * k for u, k in units.items()) * p
        if params == "host":
            out.append(Transfer("params", "host", reads))
        else:
            out.append(Transfer("params", "disk_read", reads, overlapped=True))
            out.append(Transfer("params", "host", reads, overlapped=True))
    if zero3 and f == 1.0:
        out.append(Transfer("grads", "host", m * n * g))
    elif f:
        out.append(Transfer("grads", "host", 4 * f * n))
    if f and layout.optimizer_offload == "disk":
        out.append(Transfer("optimizer", "disk_read", 12 * f * n))
        out.append(Transfer("optimizer", "disk_write", 12 * f * n))
    if params == "disk":
        if not (p == 4 and layout.optimizer_offload == "disk"):
            out.append(Transfer("params", "disk_write", f * n * p))
    elif params == "host" and not f:
        out.append(Transfer("params", "host", n * p))
    elif f and params == "device":
        out.append(Transfer("optimizer", "host", f * n * p))
    out += _activation_transfers(c, layout, m=m, activation_bytes=activation_bytes)
    return [t for t in out if t.nbytes > 0]


def _activation_transfers(
    c: GPTConfig, layout: Layout, *, m: int, activation_bytes: tuple[int, int]
) -> list[Transfer]:
    """``--cpu-offloading``: each chunk's first N layers out in forward and back in backward."""
    if not c.cpu_offloading or not c.cpu_offloading_num_layers:
        return []
    per_layer, chunk_input = activation_bytes
    k = c.cpu_offloading_num_layers
    moved = 0
    for i in range(k):  # a recomputed layer's region saves its checkpoint's input alone
        if c.recompute_granularity != "full":
            moved += per_layer
        elif c.recompute_method == "block":
            moved += chunk_input if i < (c.recompute_num_layers or 0) else per_layer
        elif i % c.recompute_num_layers == 0:  # uniform: a chunk moves with its first layer
            moved += chunk_input
    chunks = max(layout.vp, 1)
    return [Transfer("activations", "host", 2 * m * chunks * moved, overlapped=True)]


def offload_seconds(
    transfers: list[Transfer], cluster: Cluster, *, busy: float
) -> tuple[float, dict[str, float]]:
    """(the seconds the transfers add to the step, the seconds of each piece of state): the
    overlapped ones hide behind ``busy`` seconds of the rank's compute (on a CPU device the
    activations' copies run in line: not hidden)."""
    by_what: dict[str, float] = {}
    exposed = hidden = 0.0
    for t in transfers:
        seconds = cluster.offload_seconds(t.link, t.nbytes)
        by_what[t.what] = by_what.get(t.what, 0.0) + seconds
        in_line = t.what == "activations" and cluster.device == "cpu"
        if t.overlapped and not in_line:
            hidden += seconds
        else:
            exposed += seconds
    return exposed + exposed_seconds(hidden, busy), by_what
