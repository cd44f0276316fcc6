"""The search: every layout pretrain_gpt.py would accept for a model on a cluster, with its
predicted memory and step time, the ones that fit ranked by tokens/s.

Validation is pretrain_gpt.py's own: each candidate's flags (the model's, the layout's and the
batch's) go through ``training.arguments.parse_args`` for a world of ``cluster.gpus`` ranks, and
the mesh through ``core.mesh_layout.mesh_sizes``; whatever those refuse, the planner refuses with
their one-line message. Candidates: TP up to a node, PP dividing the world, DP the rest; SP on
under TP; every available ZeRO rung; every schedule under PP; micro-batch sizes that divide the
per-rank batch; recompute none / selective / full.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from megalite.core.mesh_layout import mesh_sizes
from megalite.planning.activations import MODELLED_SCHEDULES
from megalite.planning.cluster import Cluster
from megalite.planning.model_state import ZERO_RUNGS
from megalite.planning.predict import Layout, RankMemory, predict_memory
from megalite.planning.step_time import StepTime, predict_step_time

VALIDATION_FLAGS = ["--lr", "1e-4", "--train-iters", "1", "--mock-data",
                    "--tokenizer-type", "NullTokenizer"]  # fmt: skip


@dataclass
class Candidate:
    layout: Layout
    argv: list[str]  # the full pretrain_gpt.py flags
    error: str | None = None  # refused by pretrain_gpt.py's validation
    memory: list[RankMemory] = field(default_factory=list)
    step: StepTime | None = None
    fits: bool = False

    @property
    def peak_bytes(self) -> int:
        return max((r.total for r in self.memory), default=0)


def validate(model_argv: list[str], layout: Layout, *, vocab_size: int, global_batch_size: int,
             seq_length: int | None = None, extra: list[str] = ()):  # fmt: skip
    """The ``PretrainConfig`` pretrain_gpt.py builds for these flags on ``layout.world_size``
    ranks (``ConfigError``/``ValueError`` with its one-line message if it refuses them)."""
    from megalite.training.arguments import parse_args

    argv = [*model_argv, *layout.flags(), "--global-batch-size", str(global_batch_size),
            *VALIDATION_FLAGS, "--vocab-size", str(vocab_size), *extra]  # fmt: skip
    if seq_length is not None:
        argv += ["--seq-length", str(seq_length)]
    env = {"WORLD_SIZE": str(layout.world_size), "RANK": "0"}
    cfg = parse_args(argv, env=env)
    mesh_sizes(
        layout.world_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    return cfg, argv


def candidate_layouts(cluster: Cluster, *, global_batch_size: int) -> list[Layout]:
    n = cluster.gpus
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    rungs = [r for r, v in ZERO_RUNGS.items() if v.available]
    for tp, pp in itertools.product(divisors, divisors):
        if n % (tp * pp) or tp > cluster.gpus_per_node:
            continue
        dp = n // (tp * pp)
        per_rank = global_batch_size // dp if global_batch_size % dp == 0 else 0
        mbs = [b for b in (1, 2, 4, 8, 16) if per_rank and per_rank % b == 0] or [1]
        for sp, rung, schedule, b, rc in itertools.product(
            [tp > 1], rungs if dp > 1 else ["no_shard"],
            list(MODELLED_SCHEDULES) if pp > 1 else ["1f1b"], mbs, [None, "selective", "full"],
        ):  # fmt: skip
            vp = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
            out.append(Layout(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, rung=rung,
                              schedule=schedule, micro_batch_size=b, recompute=rc,
                              vp=vp))  # fmt: skip
    return out


def evaluate(
    model_argv: list[str],
    layout: Layout,
    cluster: Cluster,
    *,
    vocab_size: int,
    global_batch_size: int,
    extra: list[str] = (),
) -> Candidate:
    try:
        cfg, argv = validate(
            model_argv, layout, vocab_size=vocab_size, global_batch_size=global_batch_size,
            extra=extra,
        )  # fmt: skip
    except ValueError as e:
        return Candidate(layout, [], error=str(e).splitlines()[0])
    precision = cfg.optimizer.precision_name
    par = cfg.parallel
    memory = predict_memory(
        cfg.model,
        layout,
        global_batch_size=global_batch_size,
        precision=precision,
        bucket_size=par.bucket_size(layout.dp),
        grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        device=cluster.device,
    )
    step = predict_step_time(
        cfg.model, layout, cluster, global_batch_size=global_batch_size, precision=precision,
        overlap_grad_reduce=par.overlap_grad_reduce,
    )  # fmt: skip
    cand = Candidate(layout, argv, memory=memory, step=step)
    cand.fits = cand.peak_bytes <= cluster.usable_bytes
    return cand


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fit, best first
    rejected: list[Candidate]  # refused by validation or too big


def search(
    model_argv: list[str],
    cluster: Cluster,
    *,
    vocab_size: int,
    global_batch_size: int,
    extra: list[str] = (),
    layouts: list[Layout] | None = None,
) -> SearchResult:
    ranked, rejected = [], []
    for layout in layouts or candidate_layouts(cluster, global_batch_size=global_batch_size):
        cand = evaluate(
            model_argv, layout, cluster, vocab_size=vocab_size,
            global_batch_size=global_batch_size, extra=extra,
        )  # fmt: skip
        (ranked if cand.error is None and cand.fits else rejected).append(cand)
    ranked.sort(key=lambda c: -c.step.tokens_per_s)
    return SearchResult(ranked, rejected)


def family_of(layout: Layout) -> tuple[int, int, int]:
    return (layout.tp, layout.pp, layout.dp)


def explain(result: SearchResult, cluster: Cluster) -> list[str]:
    """One line per (TP, PP, DP) family: its best fitting layout's rank, or why none fits."""
    lines = []
    families: dict[tuple[int, int, int], list[Candidate]] = {}
    for c in result.ranked + result.rejected:
        families.setdefault(family_of(c.layout), []).append(c)
    position = {id(c): i for i, c in enumerate(result.ranked)}
    for fam in sorted(families):
        cands = families[fam]
        name = f"TP{fam[0]} PP{fam[1]} DP{fam[2]}"
        fitting = [c for c in cands if id(c) in position]
        if fitting:
            best = min(fitting, key=lambda c: position[id(c)])
            lines.append(
                f"{name}: best is #{position[id(best)] + 1} ({best.layout.name()}, "
                f"{best.step.tokens_per_s:,.0f} tokens/s)"
            )
            continue
        valid = [c for c in cands if c.error is None]
        if not valid:
            lines.append(f"{name}: refused by pretrain_gpt.py: {cands[0].error}")
            continue
        smallest = min(valid, key=lambda c: c.peak_bytes)
        lines.append(
            f"{name}: does not fit: the smallest layout ({smallest.layout.name()}) needs "
            f"{smallest.peak_bytes / 2**30:.1f} GiB on its fullest rank, "
            f"{cluster.usable_bytes / 2**30:.1f} GiB usable per GPU"
        )
    return lines
