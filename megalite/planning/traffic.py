"""The collectives and messages of a training step, as the planner counts them.

    fwd, bwd = pass_traffic(c, layout, n_layers=2, n_moe=0, first=True, last=False, e=4)
    per_step = step_traffic(c, layout, pp_rank=0, m=4, e=4)

A ``Comm`` is one op (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``p2p``)
over ``n`` ranks on a group spanning ``span`` consecutive global ranks, of ``nbytes`` (the full
tensor as ``measure.comm_log.CommLog`` counts it: an all-gather's output, a reduce-scatter's
input, one message), ``count`` times. ``step_time`` charges each with
``Cluster.collective_seconds``; ``tests/planning/test_traffic.py`` holds the counts against a
real step's ``CommLog``.

Per micro-batch and pass of a stage (megalite's modules, logged):

- TP: two all-reduces of ``[s, b, h]`` per layer each way, one more for the embedding (forward,
  first stage) and the output layer's input (backward, last stage); under SP each becomes an
  all-gather and a reduce-scatter pair (same placement), and each column-parallel linear's
  backward all-gathers its saved input shard again for the weight grad. The vocab-parallel
  loss: three all-reduces of ``[s, b]`` fp32 (forward, last stage). Full recompute repeats the
  recomputed layers' forward ones (``recomputed_layers``: all under ``uniform``, the first
  ``recompute_num_layers`` under ``block``).
- CP ring (``--cp-comm-type p2p``): per layer ``cp - 1`` K/V messages forward; backward the K/V
  again and ``cp`` messages of their grads (the accumulator travels round). All but the last grad
  message travel while a block computes (``overlapped``).
- MoE, allgather dispatcher (over etp x ep): forward all-gathers tokens, probabilities and the
  routing map and reduce-scatters the outputs; backward the reverse of the tokens' and the
  probabilities'. alltoall dispatcher (over ep): a count exchange and two token all-to-alls each
  way (``topk`` copies of each token).

Per step: the data-parallel grads (all-reduce; ZeRO-1/2 reduce-scatter + all-gather, ZeRO-2 every
micro-batch; ZeRO-3 gathers each unit forward and backward and reduce-scatters it every micro-
batch; on gloo ZeRO's exchanges are point-to-point messages of a shard, ``shard_collectives``),
the tied embedding's grad between the first and the last stage, SP's replicated grads over TP, and
the grad norm's scalar all-reduces.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.models.config import GPTConfig
from megalite.models.moe_config import moe_layer_pattern
from megalite.planning.comm import Comm
from megalite.planning.model_state import ParamSpec
from megalite.planning.predict import Layout, layout_params
from megalite.planning.tp_modes import mode_pass_traffic
from megalite.training.model_chunks import stage_blocks


def _keep(comms: list[Comm]) -> list[Comm]:
    return [x for x in comms if x.n > 1 and x.count > 0 and x.nbytes > 0]


def pass_traffic(
    c: GPTConfig, layout: Layout, *, n_layers: int, n_moe: int, first: bool, last: bool, e: int
) -> tuple[list[Comm], list[Comm]]:
    """(forward, backward) of one micro-batch through one stage (module docstring); under a grid
    or the cube, ``tp_modes.mode_pass_traffic``."""
    tp, cp, b, s, h = layout.tp, layout.cp, layout.micro_batch_size, c.seq_length, c.hidden_size
    if layout.tp_mode != "1d":  # (context parallelism and MoE are refused there)
        recomputed = recomputed_layers(c, n_layers)
        return mode_pass_traffic(
            c,
            layout.split,
            micro_batch_size=b,
            n_layers=n_layers,
            recomputed=recomputed,
            first=first,
            last=last,
            e=e,
        )
    tokens = s * b // cp
    act = tokens * h * e
    k = recomputed_layers(c, n_layers)
    k_moe = n_moe * k // n_layers if n_layers else 0  # (exact when all or none are MoE)
    fwd: list[Comm] = []
    bwd: list[Comm] = []
    per_layer = 2 * n_layers
    if layout.sequence_parallel:  # a MoE layer takes its input sharded: its dispatcher gathers
        per_layer -= n_moe if c.num_experts else 0
        # every all-gather follows a reduce-scatter with only a norm or a residual between
        # (forward: each block's input after the previous block's output; backward the same
        # mirrored), so the ranks meet it in step: ``synced``
        fwd.append(Comm("all_gather", tp, act, tp, per_layer + last, synced=True))
        fwd.append(Comm("reduce_scatter", tp, act, tp, per_layer + first))
        again = 2 * k - (k_moe if c.num_experts else 0)
        bwd.append(Comm("all_gather", tp, act, tp, per_layer + again + first, synced=True))
        bwd.append(Comm("reduce_scatter", tp, act, tp, per_layer + again + last))
        # each column-parallel linear saved its input shard: gathered again for dW
        bwd.append(Comm("all_gather", tp, act, tp, per_layer + last))
    else:  # (a MoE layer's output is reduced over TP once, as a dense MLP's)
        fwd.append(Comm("all_reduce", tp, act, tp, per_layer + first))
        bwd.append(Comm("all_reduce", tp, act, tp, per_layer + 2 * k + last))
    if last:
        fwd.append(Comm("all_reduce", tp, tokens * 4, tp, 3))  # the vocab-parallel loss
    if cp > 1 and c.cp_comm_type == "p2p":
        kv = 2 * tokens * (c.num_query_groups // tp) * c.kv_channels * e
        # each block's K/V (forward and backward) and dK/dV travel while a block computes; only
        # the last dK/dV of a layer's backward is waited on with nothing left to compute
        ring = dict(overlapped=True)
        fwd.append(Comm("p2p", cp, kv, tp * cp, n_layers * (cp - 1), **ring))
        redo = k * (cp - 1)
        bwd.append(Comm("p2p", cp, kv, tp * cp, n_layers * (2 * cp - 2) + redo, **ring))
        bwd.append(Comm("p2p", cp, kv, tp * cp, n_layers))
    if n_moe and c.num_experts:
        f, bk = _moe_traffic(c, layout, tokens=tokens, e=e)
        fwd += [Comm(x.op, x.n, x.nbytes, x.span, x.count * n_moe) for x in f]
        bwd += [Comm(x.op, x.n, x.nbytes, x.span, x.count * n_moe) for x in bk]
        bwd += [Comm(x.op, x.n, x.nbytes, x.span, x.count * k_moe) for x in f]
    return _keep(fwd), _keep(bwd)


def recomputed_layers(c: GPTConfig, n_layers: int) -> int:
    """Layers of a stage of ``n_layers`` whose forward full recompute runs again in backward:
    all under ``uniform``, the first ``recompute_num_layers`` under ``block``."""
    if c.recompute_granularity != "full":
        return 0
    if c.recompute_method == "block":
        return min(c.recompute_num_layers or 0, n_layers)
    return n_layers


def _moe_traffic(
    c: GPTConfig, layout: Layout, *, tokens: int, e: int
) -> tuple[list[Comm], list[Comm]]:
    """One MoE layer's (forward, backward) for this rank's ``tokens`` (``/tp`` under SP)."""
    etp = layout.etp or layout.tp
    ep, h = layout.ep, c.hidden_size
    t = tokens // layout.tp if layout.sequence_parallel else tokens
    span = etp * ep  # the expert view's order etp-ep-edp: EP groups are consecutive ranks
    if c.moe_token_dispatcher_type == "allgather":
        n = etp * ep
        x, probs = n * t * h * e, n * t * c.num_experts * 4
        fwd = [Comm("all_gather", n, x, span), Comm("all_gather", n, probs, span, 2)]
        fwd.append(Comm("reduce_scatter", n, x, span))
        bwd = [Comm("reduce_scatter", n, x, span), Comm("reduce_scatter", n, probs, span)]
        bwd.append(Comm("all_gather", n, x, span))
        return fwd, bwd
    routed = t * c.moe_router_topk * h * e
    counts = Comm("all_to_all", ep, ep * (c.num_experts // ep) * 8, span)
    fwd = [counts, Comm("all_to_all", ep, routed, span, 2)]
    bwd = [Comm("all_to_all", ep, routed, span, 2)]
    if etp > 1:  # expert TP: tokens gathered over etp, partial outputs reduce-scattered
        for comms in (fwd, bwd):
            comms.append(Comm("all_gather", etp, etp * routed, span))
            comms.append(Comm("reduce_scatter", etp, etp * routed, span))
    return fwd, bwd


def step_traffic(
    c: GPTConfig, layout: Layout, *, pp_rank: int, m: int, e: int, cpu: bool
) -> list[Comm]:
    """What pipeline rank ``pp_rank`` sends once per step, outside the passes (module
    docstring). ``cpu``: gloo, where ZeRO's reduce-scatter and all-gather are p2p exchanges."""
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    specs = layout_params(c, layout, pp_rank)
    dense = sum(p.numel for p in specs if not p.expert)
    expert = sum(p.numel for p in specs if p.expert)
    n, span = layout.dp * cp, tp * layout.dp * cp
    out: list[Comm] = []
    for numel, group, is_expert in ((dense, n, False), (expert, layout.edp, True)):
        if layout.rung == "no_shard" or group == 1:
            out.append(Comm("all_reduce", group, numel * e, span, grad_reduction=True))
            continue
        grads = m if layout.rung in ("optim_grads", "optim_grads_params") else 1
        if layout.rung == "optim_grads_params":
            units = Counter()
            for p in specs:
                if p.expert == is_expert:
                    units[p.unit] += p.numel
            tied = tied_embedding_unit(c, layout, specs, pp_rank) if not is_expert else None
            for unit, k in units.items():
                gathers = 2 * m + (m if unit == tied else 0)  # forward, backward; a tied output
                gather = _shard("all_gather", group, k * e, span, gathers, cpu=cpu)
                out.append(replace(gather, prefetched=True))
                out.append(_shard("reduce_scatter", group, k * e, span, m, cpu=cpu, grad=True))
        else:
            out.append(_shard("reduce_scatter", group, numel * e, span, grads, cpu=cpu, grad=True))
            out.append(_shard("all_gather", group, numel * e, span, 1, cpu=cpu))
    stages = layout_of(layout.schedule if pp > 1 else "1f1b", pp, layout.vp)
    first, last = stages.place(0)[0], stages.loss_rank()
    if first != last and pp_rank in (first, last) and not c.untie_embeddings_and_output_weights:
        table = layout.split.table(c)  # the tied word embeddings' grads, fp32
        out.append(Comm("all_reduce", 2, table * 4, tp * layout.dp * cp * pp))
    if pp_rank == last != pp - 1:  # a V layout: the losses to the last rank, which reports them
        out.append(Comm("p2p", 2, m * 4, tp * layout.dp * cp * pp))
    if layout.sequence_parallel:  # replicated over TP (norms, row biases, positions): one bucket
        out.append(Comm("all_reduce", tp, sp_replicated(c, specs) * 4, tp))
    scalars = 1 + (layout.rung != "no_shard" and n > 1) + bool(c.num_experts)
    out.append(Comm("all_reduce", tp * pp * n, 4, tp * pp * n, scalars))
    return _keep(out)


def tied_embedding_unit(
    c: GPTConfig, layout: Layout, specs: list[ParamSpec], pp_rank: int
) -> int | None:
    """The ZeRO-3 unit of the word embeddings when this rank also runs the output layer with
    them (tied, first and last stage on one rank): gathered once more, for the output layer."""
    stages = layout_of(layout.schedule if layout.pp > 1 else "1f1b", layout.pp, layout.vp)
    mine = {stages.stage(pp_rank, ch) for ch in range(stages.num_chunks)}
    if c.untie_embeddings_and_output_weights or not {0, stages.num_stages - 1} <= mine:
        return None
    return next(p.unit for p in specs if "word_embeddings" in p.name)


def rank_traffic(
    c: GPTConfig, layout: Layout, *, pp_rank: int, m: int, e: int, cpu: bool
) -> list[Comm]:
    """Everything pipeline rank ``pp_rank`` sends in one step of ``m`` micro-batches: the passes
    of its chunks, its pipeline messages (the schedule's sends, ``actions.with_p2p``) and
    ``step_traffic``: what ``CommLog`` records on that rank."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    stages = layout_of(schedule, layout.pp, layout.vp)
    blocks, moe = stage_blocks(c, stages), moe_layer_pattern(c)
    out: list[Comm] = []
    for ch in range(stages.num_chunks):
        st = stages.stage(pp_rank, ch)
        start, end = blocks[st]
        fwd, bwd = pass_traffic(
            c,
            layout,
            n_layers=end - start,
            n_moe=sum(moe[start:end]),
            first=st == 0,
            last=st == stages.num_stages - 1,
            e=e,
        )
        out += [Comm(x.op, x.n, x.nbytes, x.span, x.count * m) for x in fwd + bwd]
    if layout.pp > 1:
        lists = generate(
            schedule,
            pp_size=layout.pp,
            num_microbatches=m,
            num_chunks=stages.num_chunks,
            microbatch_group_size=layout.microbatch_group_size,
        )
        sends = sum(a.op.startswith("SEND") for a in with_p2p(lists, stages)[pp_rank])
        tokens = c.seq_length * layout.micro_batch_size // layout.cp
        act = tokens * c.hidden_size * e // layout.hidden_state_split
        out.append(Comm("p2p", 2, act, layout.world_size, sends))
    return out + step_traffic(c, layout, pp_rank=pp_rank, m=m, e=e, cpu=cpu)


def _shard(
    op: str, n: int, nbytes: float, span: int, count: float, *, cpu: bool, grad: bool = False
) -> Comm:
    if cpu:  # shard_collectives on gloo: one message of a shard to each other rank
        return Comm("p2p", n, nbytes / n, span, count * (n - 1), grad)
    return Comm(op, n, nbytes, span, count, grad)


def sp_replicated(c: GPTConfig, specs: list[ParamSpec]) -> int:
    """Elements of the params that sequence parallelism keeps whole on every TP rank."""
    names = ("norm", "layernorm", "position", "linear_proj.bias", "linear_fc2.bias", "router")
    return sum(p.numel for p in specs if any(k in p.name for k in names))


def counts(comms: list[Comm], times: float = 1.0) -> Counter:
    """``{(op, n, bytes): count}``, as ``CommLog.counts`` reports a rank's step."""
    out: Counter = Counter()
    for x in comms:
        out[(x.op, x.n if x.op != "p2p" else 2, int(x.nbytes))] += x.count * times
    return out
