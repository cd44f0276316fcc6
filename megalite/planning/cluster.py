"""The hardware a plan is for: GPUs, memory, peak FLOP/s, link bandwidths, and calibration.

Bandwidths are bus bandwidths per GPU in GB/s (10^9 bytes/s), the figure NCCL's tests report: a
ring all-reduce of ``B`` bytes over ``n`` ranks takes ``2 (n-1)/n B / bw``, an all-gather or a
reduce-scatter ``(n-1)/n B / bw``. ``efficiency`` is the achieved share of peak of the model's
matrix multiplications (calibrated: ``tools/plan.py --calibrate``), ``layer_overhead_s`` a fixed
cost per layer per micro-batch pass (kernel launches on GPU, op dispatch on CPU),
``chunk_overhead_s`` a fixed cost per pass of a model chunk, ``step_overhead_s`` a fixed cost per
step, ``cores`` the CPU cores the ranks of a CPU run share
(a rank waiting in the pipeline's bubble lends its core; 0 on GPUs: a device per rank).

Calibration file (JSON, written by ``tools/plan.py --calibrate``, ``tools/planner/calibrate.py``,
and read by ``load_calibration``)::

    {"format": "megalite-plan-calibration/1", "device": "...", "peak_tflops": 989.0,
     "efficiency": 0.62, "layer_overhead_s": 2e-5, "step_overhead_s": 0.0, "cores": 0,
     "optimizer_s_per_param": 1e-11,
     "matmul_tflops": {"1024": 410.0, ...}, "attention_tflops": 300.0,
     "collectives": {"all_reduce": {"gbps": 80.0, "latency_s": 3e-5}, "p2p": {...}},
     "host_gbps": 24.0, "disk_read_gbps": 3.1, "disk_write_gbps": 1.9}

``host_gbps`` is a pinned host <-> device copy on a GPU (a memcpy on a CPU), ``disk_*_gbps`` a
temporary file's ``write`` + ``fsync`` and its read back with the page cache dropped
(``tools/planner/calibrate_offload.py``); without them the defaults below stand (PCIe gen4 x16
~25 GB/s, NVMe ~3 GB/s read, ~2 GB/s write) and a CPU device's host copies are free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

CALIBRATION_FORMAT = "megalite-plan-calibration/1"
GIB = 2**30


def bus_factor(op: str, n: int) -> float:
    """Bytes on the busiest link per byte of the op's full tensor (nccl-tests' convention)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "p2p":
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def exposed_seconds(seconds: float, behind: float, *, floor: float = 0.0) -> float:
    """What of ``seconds`` of transfers overlapped with ``behind`` seconds of compute stays on
    the step: the part the compute does not cover, and at least ``floor`` of the whole (a
    collective's launches and final wait, which no compute hides)."""
    return max(seconds - behind, seconds * floor)


COLLECTIVE_EXPOSED_FLOOR = 0.1  # the share of an overlapped collective that stays exposed


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_memory_gib: float
    peak_tflops: float  # dense, for the training precision
    intra_node_gbps: float
    inter_node_gbps: float
    efficiency: float = 0.6
    layer_overhead_s: float = 2e-5
    chunk_overhead_s: float = 0.0  # per forward or backward pass of a model chunk
    step_overhead_s: float = 0.0  # per step, outside the micro-batches and the optimizer
    cores: float = 0.0  # CPU: cores the ranks share (0: every rank has its own device)
    collective_latency_s: float = 2e-5
    # a reduce-scatter's cost in all-reduces of the same bytes: NCCL's ring moves half (0.5);
    # gloo reduce-scatters by all-reducing (measured on this CPU: 1.06 ms both, [128, 4, 256] fp32)
    reduce_scatter_cost: float = 0.5
    optimizer_s_per_param: float = 16.0 / 2.0e12  # ~16 bytes read+written per param at HBM speed
    memory_reserve_gib: float = 4.0  # CUDA context, allocator fragmentation, NCCL buffers
    # offloaded state's links (GB/s): host <-> device (PCIe gen4 x16, effective), NVMe read and
    # write (a PCIe gen3/gen4 drive's sustained figures); calibrated by tools/plan.py --calibrate
    host_gbps: float = 25.0
    disk_read_gbps: float = 3.0
    disk_write_gbps: float = 2.0
    device: str = "cuda"  # "cpu": activations as the CPU kernels save them
    name: str = "custom"
    calibration: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_memory_gib - self.memory_reserve_gib) * GIB

    def collective_seconds(
        self,
        op: str,
        nbytes: float,
        n: int,
        span: int,
        *,
        overlapped: bool = False,
        synced: bool = False,
    ) -> float:
        """One ``op`` (``traffic.Comm``'s names) of ``nbytes`` over ``n`` ranks spanning ``span``
        consecutive global ranks: ``latency + bus_factor x bytes / bus bandwidth``, with the
        op's own calibrated figures inside a node where the calibration has them (measured
        between busy ranks, ``tools/planner/calibrate_comm.py``), else the link's bandwidth and
        ``collective_latency_s`` (a reduce-scatter: ``reduce_scatter_cost`` of an all-reduce).
        ``overlapped``: posted before compute and waited on after it (the CP ring), so no rank
        sleeps through the latency: the transfer alone. ``synced``: right after another collective
        of the same ranks with only elementwise work between, so the ranks arrive in step: the
        op's idle latency where calibrated."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        figures = self.calibration.get("collectives", {}).get(op, {})
        if "gbps" in figures and span <= self.gpus_per_node:
            latency, gbps = figures["latency_s"], figures["gbps"]
            if synced:
                latency = figures.get("idle_latency_s", latency)
        elif op == "reduce_scatter":
            return self.reduce_scatter_cost * self.collective_seconds(
                "all_reduce", nbytes, n, span, overlapped=overlapped, synced=synced
            )
        else:
            latency, gbps = self.collective_latency_s, self.link_gbps(span)
        return (0.0 if overlapped else latency) + bus_factor(op, n) * nbytes / (gbps * 1e9)

    def offload_seconds(self, link: str, nbytes: float) -> float:
        """``nbytes`` over an offload link: ``host`` (a host <-> device copy; free on a CPU
        "device", whose host memory is its own, unless the calibration measured the memcpy),
        ``disk_read`` or ``disk_write`` (NVMe)."""
        if nbytes <= 0:
            return 0.0
        if link == "host" and self.device == "cpu" and "host_gbps" not in self.calibration:
            return 0.0
        gbps = {
            "host": self.host_gbps,
            "disk_read": self.disk_read_gbps,
            "disk_write": self.disk_write_gbps,
        }[link]
        return nbytes / (gbps * 1e9)

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a group whose ranks span ``span`` consecutive global ranks."""
        return self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps


# Vendors' data sheets (dense bf16; NVLink per GPU one direction) and common fabrics (one
# 400 Gb/s NIC per H100/H200 GPU = 50 GB/s; 200 Gb/s per A100 = 25 GB/s). Achieved bus bandwidth
# is lower than the link's rating; these are the usual measured figures (nccl-tests). The default
# efficiency (share of peak the model's GEMMs reach, other ops folded in) is an assumption, not a
# fit: calibrate on the GPUs you plan for.
_PRESET_FIELDS = (
    "gpu_memory_gib",
    "peak_tflops",
    "intra_node_gbps",
    "inter_node_gbps",
    "gpus_per_node",
    "efficiency",
)
_PRESET_ROWS = {  # the fields above, in order
    "H100": (80, 989.0, 360.0, 45.0, 8, 0.6),
    "H200": (141, 989.0, 360.0, 45.0, 8, 0.6),
    "A100": (80, 312.0, 230.0, 22.0, 8, 0.7),
}
PRESETS: dict[str, dict] = {name: dict(zip(_PRESET_FIELDS, r)) for name, r in _PRESET_ROWS.items()}


def preset(name: str, gpus: int, **overrides) -> Cluster:
    if name not in PRESETS:
        raise ValueError(f"unknown GPU preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
    return Cluster(gpus=gpus, name=name, **values)


def save_calibration(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps({"format": CALIBRATION_FORMAT, **data}, indent=1) + "\n")


def load_calibration(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"--calibration {path}: cannot read it ({e}); run --calibrate first"
        ) from None
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(
            f"--calibration {path}: format {data.get('format')!r} is not {CALIBRATION_FORMAT!r}; "
            "run tools/plan.py --calibrate again"
        )
    return data


def calibrated(cluster: Cluster, data: dict) -> Cluster:
    """``cluster`` with the measured figures of a calibration file."""
    coll = data.get("collectives", {})
    ar = coll.get("all_reduce", {})
    values = dict(
        efficiency=data.get("efficiency", cluster.efficiency),
        layer_overhead_s=data.get("layer_overhead_s", cluster.layer_overhead_s),
        step_overhead_s=data.get("step_overhead_s", cluster.step_overhead_s),
        chunk_overhead_s=data.get("chunk_overhead_s", cluster.chunk_overhead_s),
        cores=data.get("cores", cluster.cores),
        optimizer_s_per_param=data.get("optimizer_s_per_param", cluster.optimizer_s_per_param),
        collective_latency_s=ar.get("latency_s", cluster.collective_latency_s),
        calibration=data,
    )
    if "peak_tflops" in data:
        values["peak_tflops"] = data["peak_tflops"]
    if "gbps" in ar:
        values["intra_node_gbps"] = ar["gbps"]
    for key in ("host_gbps", "disk_read_gbps", "disk_write_gbps"):  # the offload links
        if key in data:
            values[key] = data[key]
    return replace(cluster, **values)


def as_dict(cluster: Cluster) -> dict:
    d = asdict(cluster)
    d.pop("calibration")
    return d
