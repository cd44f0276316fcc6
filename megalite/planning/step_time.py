"""Predicted step time: compute from the FLOPs megalite logs, exposed communication, the bubble.

Per pipeline rank and micro-batch, forward compute is the rank's share of the model FLOPs
(``training.flops.model_flops_per_iteration``, split into its layers and the output layer) over
``peak x efficiency``, plus ``layer_overhead_s`` per layer; backward is twice the forward, plus
one more forward of the recomputed part (full: the layers; selective: the attention core).
Tensor-parallel collectives are exposed (megalite does not overlap them): two all-reduces per
layer forward and two backward of ``[s, b, h]`` (under sequence parallel two all-gathers and two
reduce-scatters of the same bytes). Pipeline sends are blocking ``[s, b, h]`` (``/tp`` under SP)
transfers. The pipeline itself is simulated (``simulate``) over the schedule's per-rank order of
forwards and backwards, so uneven stages and the bubble come out of the same numbers. After it,
the data-parallel grad reduction (all-reduce, or ZeRO-1's reduce-scatter + all-gather of the
params) is exposed unless ``--overlap-grad-reduce`` hides it behind the last backward, and the
optimizer step costs ``optimizer_s_per_param`` per parameter on the rank.

Schedules are per-rank orders of ``("F", mb)`` / ``("B", mb)`` (``SCHEDULE_ORDERS``); issue 14's
action lists (with chunks, ``I``/``W`` splits) replace these generators when they land.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megalite.models.config import GPTConfig
from megalite.planning.cluster import Cluster
from megalite.planning.model_state import DTYPE_BYTES, param_numels
from megalite.training.flops import model_flops_per_iteration


def _order_1f1b(pp_rank: int, pp: int, m: int) -> list[tuple[str, int]]:
    warmup = min(pp - pp_rank - 1, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("B", i)]
    out += [("B", i) for i in range(m - warmup, m)]
    return out


def _order_gpipe(pp_rank: int, pp: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


SCHEDULE_ORDERS: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "1f1b": _order_1f1b,
    "gpipe": _order_gpipe,
}


def simulate(
    orders: list[list[tuple[str, int]]], forward: list[float], backward: list[float], p2p: float
) -> float:
    """Makespan of a pipeline: rank r runs ``orders[r]`` in turn; F(r, mb) waits for F(r-1, mb),
    B(r, mb) for B(r+1, mb) (and for its own F), each hop costing ``p2p`` seconds."""
    pp = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                kind, mb = orders[r][position[r]]
                if kind == "F":
                    dep = done.get(("F", r - 1, mb), None) if r > 0 else 0.0
                    cost = forward[r]
                else:
                    dep = done.get(("B", r + 1, mb), None) if r < pp - 1 else 0.0
                    own = done.get(("F", r, mb))
                    dep = None if dep is None or own is None else max(dep, own)
                    cost = backward[r]
                if dep is None:
                    break
                hop = p2p if (kind == "F" and r > 0) or (kind == "B" and r < pp - 1) else 0.0
                start = max(clock[r], dep + hop)
                clock[r] = done[(kind, r, mb)] = start + cost
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks (a dependency is never produced)")
    return max(clock)


@dataclass
class StepTime:
    seconds: float
    compute: float  # the busiest rank's forward + backward compute over the step
    tp_comm: float  # exposed TP collectives (inside compute's stage times)
    pp_comm: float  # p2p per hop
    bubble: float  # pipeline makespan minus the busiest rank's work
    dp_comm: float  # exposed data-parallel reduction
    optimizer: float
    tokens_per_s: float
    mfu: float  # percent of peak, model FLOPs (as megalite logs)


def _ring(bytes_: float, n: int, gbps: float, latency: float, *, factor: float) -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return latency + factor * (n - 1) / n * bytes_ / (gbps * 1e9)


def predict_step_time(
    c: GPTConfig,
    layout,
    cluster: Cluster,
    *,
    global_batch_size: int,
    precision: str,
    overlap_grad_reduce: bool = False,
) -> StepTime:
    tp, pp, dp, b = layout.tp, layout.pp, layout.dp, layout.micro_batch_size
    s, e = c.seq_length, DTYPE_BYTES[precision]
    m = global_batch_size // (b * dp)
    vocab = c.padded_vocab_size(tp)
    common = dict(
        hidden_size=c.hidden_size, seq_length=s, global_batch_size=b,
        ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
        kv_channels=c.kv_channels, num_query_groups=c.num_query_groups, swiglu=c.swiglu,
    )  # fmt: skip
    layer_flops = model_flops_per_iteration(num_layers=1, padded_vocab_size=0, **common) / 3
    output_flops = model_flops_per_iteration(num_layers=0, padded_vocab_size=vocab, **common) / 3
    core_attention = 4 * s * c.num_attention_heads * c.kv_channels * s * b  # QK^T and x V
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency
    tokens = s * b
    act_bytes = tokens * c.hidden_size * e
    tp_gbps = cluster.link_gbps(tp)
    factor = 1.0 if layout.sequence_parallel else 2.0  # an AG or RS moves half an all-reduce
    per_collective = _ring(act_bytes, tp, tp_gbps, cluster.collective_latency_s, factor=factor)
    forward, backward, busiest = [], [], 0.0
    tp_comm = 0.0
    for r, (start, end) in enumerate(c.stage_layer_ranges(pp)):
        n_layers = end - start
        fwd_flops = n_layers * layer_flops + (output_flops if r == pp - 1 else 0.0)
        recompute = 0.0
        if c.recompute_granularity == "full":
            recompute = n_layers * layer_flops
        elif c.recompute_granularity == "selective":
            recompute = n_layers * core_attention
        f = fwd_flops / tp / rate + n_layers * cluster.layer_overhead_s
        bwd = (2 * fwd_flops + recompute) / tp / rate + 2 * n_layers * cluster.layer_overhead_s
        comm_f = 2 * n_layers * per_collective
        comm_b = (4 if c.recompute_granularity == "full" else 2) * n_layers * per_collective
        forward.append(f + comm_f)
        backward.append(bwd + comm_b)
        busiest = max(busiest, m * (f + bwd))
        tp_comm = max(tp_comm, m * (comm_f + comm_b))
    pp_span = tp * dp * pp  # with the default order PP is the slowest axis
    send = act_bytes / (tp if layout.sequence_parallel else 1)
    p2p = cluster.collective_latency_s + send / (cluster.link_gbps(pp_span) * 1e9) if pp > 1 else 0
    orders = [SCHEDULE_ORDERS[layout.schedule](r, pp, m) for r in range(pp)]
    makespan = simulate(orders, forward, backward, p2p)
    busiest_total = max(m * (f + bw) for f, bw in zip(forward, backward))
    # data parallel: the largest stage's grads
    params = max(sum(n for _, n in param_numels(c, tp=tp, pp=pp, pp_rank=r)) for r in range(pp))
    grad_bytes = params * e
    dp_gbps = cluster.link_gbps(tp * dp)
    if layout.rung == "no_shard":
        dp_comm = _ring(grad_bytes, dp, dp_gbps, cluster.collective_latency_s, factor=2.0)
    else:  # reduce-scatter grads, all-gather params
        dp_comm = 2 * _ring(grad_bytes, dp, dp_gbps, cluster.collective_latency_s, factor=1.0)
    if overlap_grad_reduce:
        dp_comm = max(dp_comm - backward[0], dp_comm * 0.1)
    shard = dp if layout.rung != "no_shard" else 1
    optimizer = params / shard * cluster.optimizer_s_per_param
    seconds = makespan + dp_comm + optimizer
    model_flops = model_flops_per_iteration(
        num_layers=c.num_layers, padded_vocab_size=vocab,
        **{**common, "global_batch_size": global_batch_size},
    )  # fmt: skip
    world = tp * pp * dp
    mfu = 100.0 * model_flops / (seconds * world * cluster.peak_tflops * 1e12)
    return StepTime(
        seconds=seconds,
        compute=busiest,
        tp_comm=tp_comm,
        pp_comm=p2p,
        bubble=makespan - busiest_total,
        dp_comm=dp_comm,
        optimizer=optimizer,
        tokens_per_s=global_batch_size * s / seconds,
        mfu=mfu,
    )
