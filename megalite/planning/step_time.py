"""Predicted step time: compute from the FLOPs megalite logs, exposed communication, the bubble.

Per pipeline rank and micro-batch, forward compute is the rank's share of the model FLOPs
(``training.flops.model_flops_per_iteration``, split into its layers and the output layer) over
``peak x efficiency``, plus ``layer_overhead_s`` per layer and ``chunk_overhead_s`` per pass of a
model chunk (the schedule's own work for one micro-batch: data, embedding, loss, the executor);
backward is twice the forward, plus one more forward of the recomputed part (full: the layers;
selective: the attention core).
Tensor-parallel collectives are exposed (megalite does not overlap them): two all-reduces per
layer forward and two backward of ``[s, b, h]`` (under sequence parallel two all-gathers and two
reduce-scatters, each with its own latency; a reduce-scatter costs ``reduce_scatter_cost`` of an
all-reduce), and one more each way per micro-batch for the embedding and the output layer.
Under a grid (2d, 2.5d) or the cube (3d) the mode's own collectives instead
(``tp_modes.mode_pass_traffic``), each on the link its sub-group spans, and the hidden states
between stages are the rank's block (``1/tp``).
Pipeline sends are blocking ``[s, b, h]`` (``/tp`` under SP)
transfers. The pipeline itself is the core simulator (``pipeline_parallel.simulator``) over the
schedule's own action lists (every schedule: 1F1B, GPipe, interleaved, ZB-H1, ZBV, DualPipeV), so
the bubble comes out of the same numbers. Context parallelism divides a rank's tokens by ``cp`` and
adds the ring's K/V passes (forward) and dK/dV passes (backward); a MoE layer computes ``topk``
experts per token and moves its tokens to the experts and back (all-to-all or all-gather). After it,
the data-parallel grad reduction (all-reduce, or ZeRO-1's reduce-scatter + all-gather of the
params; ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers the params forward and
backward; expert grads over edp) is exposed unless ``--overlap-grad-reduce`` hides it behind the
last backward, and the optimizer step costs ``optimizer_s_per_param`` per parameter on the rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megalite.core.pipeline_parallel import simulator
from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.models.attention_mask import attention_fraction
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern
from megalite.planning.cluster import COLLECTIVE_EXPOSED_FLOOR, Cluster, exposed_seconds
from megalite.planning.model_state import DTYPE_BYTES
from megalite.planning.offload_time import offload_seconds, offload_transfers
from megalite.planning.predict import Layout, layout_activations, layout_params
from megalite.planning.schedule_replay import schedule_lists
from megalite.planning.traffic import (
    pass_traffic,
    recomputed_layers,
    step_traffic,
    tied_embedding_unit,
)
from megalite.training.flops import model_flops_per_iteration
from megalite.training.model_chunks import stage_blocks


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
    fixed: float = 0.0  # per-step costs outside the passes (zeroing grads, loss, grad norm)
    offload: float = 0.0  # what offloaded state's transfers add (offload_time), busiest rank
    offload_by: dict = field(default_factory=dict)  # their seconds per piece of state, that rank


def _layer_forward_flops(c: GPTConfig, *, tokens: int, s: int, moe: bool) -> float:
    """Forward FLOPs of one transformer layer for ``tokens`` tokens of sequences of ``s`` (each
    token attends over ``s``, also under CP): the formula megalite logs; a MoE layer's MLP counts
    its ``topk`` experts per token (the router's ``2 h E`` too)."""
    common = dict(
        hidden_size=c.hidden_size,
        seq_length=s,
        global_batch_size=1,
        num_attention_heads=c.num_attention_heads,
        kv_channels=c.kv_channels,
        num_query_groups=c.num_query_groups,
        swiglu=c.swiglu,
        padded_vocab_size=0,
        attention_fraction=attention_fraction(c),
    )
    per_token = tokens / (3 * s)
    attention = model_flops_per_iteration(num_layers=1, ffn_hidden_size=0, **common) * per_token
    if not moe:
        mlp = model_flops_per_iteration(num_layers=1, ffn_hidden_size=c.ffn_hidden_size, **common)
        return mlp * per_token
    f = c.moe_ffn_hidden_size or c.ffn_hidden_size
    expert = (6 if c.swiglu else 4) * c.hidden_size * f * tokens
    router = 2 * c.hidden_size * c.num_experts * tokens
    return attention + c.moe_router_topk * expert + router


@functools.lru_cache(maxsize=512)
def pipeline_program(schedule: str, pp: int, m: int, vp: int, group: int | None) -> tuple:
    """The schedule's action lists with their sends and receives, one per pipeline rank: the same
    for every layout with this schedule and shape (the search asks for it thousands of times;
    the simulator only reads it)."""
    lists = [list(rank) for rank in schedule_lists(schedule, pp, m, vp, group)]
    return tuple(tuple(rank) for rank in with_p2p(lists, layout_of(schedule, pp, vp)))


@functools.lru_cache(maxsize=4096)
def simulated_step(
    schedule: str,
    pp: int,
    m: int,
    vp: int,
    group: int | None,
    stages: tuple,
    p2p: float,
    cores: float | None,
) -> float:
    """The simulator's step time of ``pipeline_program`` at per-stage (F, I, W) costs ``stages``:
    layouts that differ only in what the pipeline does not see (the ZeRO rung, offload) share
    one replay."""
    program = pipeline_program(schedule, pp, m, vp, group)
    costs = simulator.Costs(stages=list(stages), p2p=p2p)
    return simulator.simulate(program, layout_of(schedule, pp, vp), costs, cores=cores).step_time


def predict_step_time(
    c: GPTConfig,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch_size: int,
    precision: str,
    overlap_grad_reduce: bool = False,
    grads_in_fp32: bool | None = None,
) -> StepTime:
    """The step of ``layout`` (module docstring). The pipeline is the core simulator
    (``pipeline_parallel.simulator.simulate``) run over the schedule's own action lists
    (``generators.generate``) with each stage's own costs (``Costs(stages=...)``) and, on a CPU,
    the ranks sharing its cores; its makespan less the busiest rank's work is the bubble.
    Offloaded state adds its transfers (``offload_time``; ``grads_in_fp32``: the grad buffers'
    dtype, None: Megatron's default for ``precision``)."""

    def cost(comms) -> float:
        seconds = cluster.collective_seconds
        return sum(
            seconds(x.op, x.nbytes, x.n, x.span, overlapped=x.overlapped, synced=x.synced) * x.count
            for x in comms
        )

    tp, pp, dp, b = layout.tp, layout.pp, layout.dp, layout.micro_batch_size
    cp = layout.cp
    s, e = c.seq_length, DTYPE_BYTES[precision]
    m = global_batch_size // (b * dp)
    vocab = c.padded_vocab_size(layout.split.q)
    h = c.hidden_size
    tokens = s * b // cp  # this CP rank's tokens of a micro-batch
    output_flops = 2 * h * vocab * tokens
    core_attention = 4 * s * c.num_attention_heads * c.kv_channels * s * b / cp
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency
    act_bytes = tokens * h * e
    moe = moe_layer_pattern(c)
    stages = layout_of(layout.schedule if pp > 1 else "1f1b", pp, layout.vp)
    blocks = stage_blocks(c, stages)
    # a layer's forward FLOPs depend only on whether it is a MoE layer: each figure once
    layer_flops = {x: _layer_forward_flops(c, tokens=tokens, s=s, moe=x) for x in set(moe)}
    stage_f, stage_b, stage_comm = [], [], []
    for st, (start, end) in enumerate(blocks):
        n_layers = end - start
        fwd_flops = sum(layer_flops[moe[i]] for i in range(start, end))
        fwd_flops += output_flops if st == stages.num_stages - 1 else 0.0
        recompute = 0.0
        if c.recompute_granularity == "full":  # uniform: every layer; block: the first k
            k = recomputed_layers(c, n_layers)
            recompute = sum(layer_flops[moe[i]] for i in range(start, start + k))
        elif c.recompute_granularity == "selective":
            recompute = n_layers * core_attention
        f = fwd_flops / tp / rate + n_layers * cluster.layer_overhead_s + cluster.chunk_overhead_s
        bwd = (2 * fwd_flops + recompute) / tp / rate + 2 * n_layers * cluster.layer_overhead_s
        bwd += cluster.chunk_overhead_s
        n_moe = sum(moe[start:end])
        last = st == stages.num_stages - 1
        fwd_c, bwd_c = pass_traffic(
            c, layout, n_layers=n_layers, n_moe=n_moe, first=st == 0, last=last, e=e
        )
        comm_f, comm_b = cost(fwd_c), cost(bwd_c)
        stage_f.append(f + comm_f)
        stage_b.append(bwd + comm_b)
        stage_comm.append(comm_f + comm_b)
    pp_span = tp * dp * cp * pp  # with the default order PP is the slowest axis
    send = act_bytes / layout.hidden_state_split
    p2p = cluster.collective_seconds("p2p", send, 2, pp_span) if pp > 1 else 0.0
    chunks = stages.num_chunks

    def on_rank(r: int, per_stage) -> float:
        """``per_stage(stage)`` over pipeline rank ``r``'s chunks, for ``m`` micro-batches."""
        return m * sum(per_stage(stages.stage(r, ch)) for ch in range(chunks))

    busy_rank = [on_rank(r, lambda x: stage_f[x] + stage_b[x]) for r in range(pp)]
    busiest_total = max(busy_rank)
    world = tp * pp * dp * cp
    shared = 0 < cluster.cores < world  # CPU: ranks are processes sharing the cores
    slow = world / cluster.cores if shared else 1.0  # every rank busy: each gets cores / world
    if pp > 1:
        # B = I + W with half of the backward in W (the weight-grad GEMMs); a pipeline rank is
        # world // pp processes computing in step: cores / group per rank
        costs = tuple((f, bw / 2, bw / 2) for f, bw in zip(stage_f, stage_b))
        cores = cluster.cores / (world // pp) if shared else None
        simulated = simulated_step(
            layout.schedule, pp, m, layout.vp, layout.microbatch_group_size, costs, p2p, cores
        )
        makespan = simulated if shared else max(simulated, busiest_total)
    else:  # the collectives were calibrated among the same sharing ranks: not slowed again
        comm = on_rank(0, stage_comm.__getitem__)
        makespan = (busiest_total - comm) * slow + comm
    busiest = max(on_rank(r, lambda x: stage_f[x] + stage_b[x] - stage_comm[x]) for r in range(pp))
    tp_comm = max(on_rank(r, stage_comm.__getitem__) for r in range(pp))
    # per step: the data-parallel grads (ZeRO-2/3: every micro-batch), the tied embedding, SP's
    # replicated grads, the grad norm (traffic.step_traffic), on the rank that sends the most
    # (a grad reduction hides behind the backward under --overlap-grad-reduce; ZeRO-3's gathers
    # and the rest do not)
    cpu = cluster.device == "cpu"

    def per_step(r: int) -> float:
        comms = step_traffic(c, layout, pp_rank=r, m=m, e=e, cpu=cpu)
        grads = cost([x for x in comms if x.grad_reduction])
        if overlap_grad_reduce:
            grads = exposed_seconds(grads, stage_b[0], floor=COLLECTIVE_EXPOSED_FLOOR)
        gathers = cost([x for x in comms if x.prefetched])
        if not cpu:  # a device's collectives run beside its compute; on a CPU they take its core
            gathers = exposed_seconds(gathers, busy_rank[r], floor=COLLECTIVE_EXPOSED_FLOOR)
        rest = cost([x for x in comms if not (x.grad_reduction or x.prefetched)])
        return grads + gathers + rest

    dp_comm = max(per_step(r) for r in range(pp))

    params = max(sum(p.numel for p in layout_params(c, layout, r)) for r in range(pp))
    dp_n = dp * cp
    shard = dp_n if layout.rung != "no_shard" else 1
    optimizer = params / shard * cluster.optimizer_s_per_param
    optimizer *= slow
    fixed = cluster.step_overhead_s * slow
    offload, offload_by = 0.0, {}
    offloads = layout.offload_fraction or layout.param_offload != "device" or c.cpu_offloading
    for r in range(pp) if offloads else ():
        transfers = offload_transfers(
            c,
            layout,
            pp_rank=r,
            m=m,
            precision=precision,
            grads_in_fp32=grads_in_fp32,
            activation_bytes=_offloaded_activation_bytes(c, layout, cluster, r, m, precision),
            tied_unit=tied_embedding_unit(c, layout, layout_params(c, layout, r), r),
        )
        exposed, by_what = offload_seconds(transfers, cluster, busy=busy_rank[r])
        if exposed >= offload:
            offload, offload_by = exposed, by_what
    seconds = makespan + dp_comm + optimizer + fixed + offload
    model_flops = model_flops_per_iteration(
        num_layers=c.num_layers,
        padded_vocab_size=vocab,
        hidden_size=h,
        seq_length=s,
        global_batch_size=global_batch_size,
        ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        kv_channels=c.kv_channels,
        num_query_groups=c.num_query_groups,
        swiglu=c.swiglu,
        attention_fraction=attention_fraction(c),
    )
    if c.num_experts:  # the FLOPs a MoE model does: topk experts per token
        dense_mlp = _layer_forward_flops(c, tokens=s, s=s, moe=False)
        moe_mlp = _layer_forward_flops(c, tokens=s, s=s, moe=True)
        model_flops += 3 * sum(moe) * (moe_mlp - dense_mlp) * global_batch_size
    mfu = 100.0 * model_flops / (seconds * world * cluster.peak_tflops * 1e12)
    return StepTime(
        seconds=seconds,
        compute=busiest,
        tp_comm=tp_comm,
        pp_comm=p2p,
        bubble=max(makespan - busiest_total * slow, 0.0),
        dp_comm=dp_comm,
        optimizer=optimizer,
        tokens_per_s=global_batch_size * s / seconds,
        mfu=mfu,
        fixed=fixed,
        offload=offload,
        offload_by=offload_by,
    )


def _offloaded_activation_bytes(
    c: GPTConfig, layout: Layout, cluster: Cluster, pp_rank: int, m: int, precision: str
) -> tuple[int, int]:
    """(one layer's saved bytes, a chunk input's bytes) on pipeline rank ``pp_rank``, what
    ``--cpu-offloading`` moves per layer (without it: nothing to move)."""
    if not c.cpu_offloading:
        return 0, 0
    acts = layout_activations(
        c,
        layout,
        pp_rank=pp_rank,
        num_microbatches=m,
        precision=precision,
        device=cluster.device,
    )
    tokens = c.seq_length * layout.micro_batch_size // layout.cp
    chunk_input = tokens * c.hidden_size * DTYPE_BYTES[precision] // layout.hidden_state_split
    return acts.per_layer, chunk_input
