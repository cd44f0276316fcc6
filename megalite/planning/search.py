"""The search: every layout pretrain_gpt.py would accept for a model on a cluster, with its
predicted memory and step time, the ones that fit ranked by tokens/s.

Validation is pretrain_gpt.py's own: each candidate's flags (the model's, the layout's and the
batch's) go through ``training.arguments.parse_args`` for a world of ``cluster.gpus`` ranks, and
the mesh through ``core.mesh_layout.mesh_sizes``; whatever those refuse, the planner refuses with
their one-line message. Candidates (``SearchSpace``): TP up to a node under 1d, and under the
grid modes (2d, 2.5d, 3d) every TP size of their shape (q^2, d q^2, q^3) on any number of nodes
(``tp_modes_of``; their micro-batches a multiple of the grid's batch blocks), PP and CP dividing
the world (CP while each CP rank keeps ``min_tokens_per_cp_rank`` of a sequence), DP the rest; on a
MoE model every EP dividing the experts, with ETP = TP or 1; SP on under 1d TP; every available ZeRO
rung; every schedule under PP (interleaved with each ``interleaved_vp``); micro-batch sizes that
divide the per-rank batch; recompute none / selective / the first 1 or 2 layers of each chunk
(block) / full; offload where asked (``SearchSpace.offload``).

Work is bounded without changing a prediction: one argument parser serves every validation, the
schedule's action lists are built once per shape (``step_time.pipeline_program``), a layout's
step time is predicted only once its memory fits, and a layout is not evaluated with more
recompute once it fits with a lighter one (``lighter``: recompute only adds compute and
traffic, so it cannot rank higher); ``SearchResult.dominated`` counts those, ``exhaustive=True``
evaluates them too.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
from dataclasses import dataclass, field, replace

from megalite.core.mesh_layout import TP_MODES, mesh_sizes
from megalite.core.pipeline_parallel.generators import V_SHAPED
from megalite.models.config import GPTConfig
from megalite.planning.activations import MODELLED_SCHEDULES
from megalite.planning.cluster import Cluster
from megalite.planning.explain import family_of
from megalite.planning.model_state import ZERO_RUNGS
from megalite.planning.predict import Layout, RankMemory, predict_memory
from megalite.planning.step_time import StepTime, predict_step_time
from megalite.planning.tp_split import TPSplit
from megalite.training.arguments import build_parser, parse_args
from megalite.training.config import PretrainConfig

# the flags validation needs besides the model's and the layout's (placeholders: no run follows)
VALIDATION_FLAGS = ["--lr", "1e-4", "--train-iters", "1", "--mock-data"]
VALIDATION_FLAGS += ["--tokenizer-type", "NullTokenizer"]


@dataclass
class Candidate:
    layout: Layout
    argv: list[str]  # the full pretrain_gpt.py flags
    error: str | None = None  # refused by pretrain_gpt.py's validation
    memory: list[RankMemory] = field(default_factory=list)
    step: StepTime | None = None
    fits: bool = False
    model: GPTConfig | None = None  # the validated model options (``explain`` compares modes)

    @property
    def peak_bytes(self) -> int:
        return max((r.total for r in self.memory), default=0)


def validate(
    model_argv: list[str],
    layout: Layout,
    *,
    vocab_size: int,
    global_batch_size: int,
    seq_length: int | None = None,
    extra: list[str] = (),
    parser=None,
) -> tuple[PretrainConfig, list[str]]:
    """The ``PretrainConfig`` pretrain_gpt.py builds for these flags on ``layout.world_size``
    ranks (``ConfigError``/``ValueError`` with its one-line message if it refuses them), and the
    flags."""
    argv = [*model_argv, *layout.flags(), "--global-batch-size", str(global_batch_size)]
    argv += [*VALIDATION_FLAGS, "--vocab-size", str(vocab_size), *extra]
    if seq_length is not None:
        argv += ["--seq-length", str(seq_length)]
    env = {"WORLD_SIZE": str(layout.world_size), "RANK": "0"}
    cfg = parse_args(argv, env=env, parser=parser)
    mesh_sizes(
        layout.world_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        tensor_parallel_mode=layout.tp_mode,
        tensor_parallel_depth=layout.tp_depth,
    )
    return cfg, argv


@dataclass(frozen=True)
class SearchSpace:
    """The options the search enumerates beyond the mesh (module docstring)."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    # None, selective, the first 1 or 2 layers of each chunk (block), every layer (full)
    recompute: tuple[str | None, ...] = (None, "selective", "block1", "block2", "full")
    interleaved_vp: tuple[int, ...] = (2, 4)  # model chunks per rank under interleaved-1f1b
    min_tokens_per_cp_rank: int = 1024
    tp_modes: tuple[str, ...] = TP_MODES  # tensor-parallel modes to enumerate (tp_modes_of)
    # where offloaded state may live ("host", "disk"): ZeRO-2 with its optimizer state there
    # (ZeRO-Offload), ZeRO-3 with its params and optimizer state there (ZeRO-Infinity)
    offload: tuple[str, ...] = ()
    offload_dir: str | None = None  # the files of "disk" (Layout.offload_dir)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_options(num_experts: int, tp: int, dp: int, cp: int) -> list[tuple[int, int | None]]:
    """(EP, ETP) pairs for a MoE model: EP dividing the experts and, times ETP, the ranks of a
    pipeline stage (tp x dp x cp); ETP the dense TP or 1. A dense model: (1, None) alone."""
    if not num_experts:
        return [(1, None)]
    out = []
    for etp in sorted({tp, 1}, reverse=True):
        for ep in _divisors(num_experts):
            if (tp * dp * cp) % (etp * ep) == 0:
                out.append((ep, None if etp == tp else etp))
    return out


def candidate_layouts(
    cluster: Cluster,
    *,
    global_batch_size: int,
    seq_length: int | None = None,
    num_experts: int = 0,
    space: SearchSpace = SearchSpace(),
) -> list[Layout]:
    """Every layout of ``space`` on ``cluster`` (validation is ``evaluate``'s). ``seq_length``:
    the model's (CP is enumerated only when given); ``num_experts``: the MoE model's."""
    n = cluster.gpus
    out = []
    rungs = [r for r, v in ZERO_RUNGS.items() if v.available]
    for tp, pp, cp in itertools.product(_divisors(n), _divisors(n), _divisors(n)):
        if n % (tp * pp * cp):
            continue
        if cp > 1 and (seq_length is None or seq_length // cp < space.min_tokens_per_cp_rank):
            continue
        dp = n // (tp * pp * cp)
        per_rank = global_batch_size // dp if global_batch_size % dp == 0 else 0
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules = [(name, v) for name in MODELLED_SCHEDULES for v in _chunks(name, space)]
        experts = _expert_options(num_experts, tp, dp, cp)
        for mode, depth in tp_modes_of(tp, cluster.gpus_per_node, space):
            blocks = TPSplit(mode, tp, depth).batch_blocks  # a grid cuts a micro-batch in these
            mbs = [b for b in space.micro_batch_sizes if per_rank and per_rank % b == 0]
            mbs = [b for b in mbs if b % blocks == 0] or [blocks]
            for (ep, etp), (schedule, vp), b, rc in itertools.product(
                experts, schedules, mbs, space.recompute
            ):
                base = Layout(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    cp=cp,
                    ep=ep,
                    etp=etp,
                    sequence_parallel=tp > 1 and mode == "1d",
                    schedule=schedule,
                    micro_batch_size=b,
                    recompute=rc,
                    vp=vp,
                    tp_mode=mode,
                    tp_depth=depth,
                )
                # ZeRO shards over dp x cp, and the expert state over the expert DP group
                for rung in rungs if dp * cp > 1 or base.edp > 1 else ["no_shard"]:
                    out.append(replace(base, rung=rung))
                    out += _offloaded(replace(base, rung=rung), space)
    return out


def _offloaded(layout: Layout, space: SearchSpace) -> list[Layout]:
    """``layout`` with its state offloaded to each place of ``space.offload`` its rung allows."""
    out = []
    for place in space.offload:
        whole = dict(offload_fraction=1.0, optimizer_offload=place, offload_dir=space.offload_dir)
        if layout.rung == "optim_grads":
            out.append(replace(layout, **whole))
        elif layout.rung == "optim_grads_params":
            out.append(replace(layout, **whole, param_offload=place))
    return out


def tp_modes_of(tp: int, gpus_per_node: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(mode, depth) of every tensor-parallel mode of ``space`` a TP group of ``tp`` can take:
    1d within a node (its traffic per device does not shrink with the group), 2d on q x q,
    2.5d on d x q x q (d >= 2), 3d on q x q x q (q >= 2), on any number of nodes."""
    out = [("1d", 1)] if tp <= gpus_per_node and "1d" in space.tp_modes else []
    for q in range(2, tp + 1):
        if "2d" in space.tp_modes and q * q == tp:
            out.append(("2d", 1))
        if "2.5d" in space.tp_modes and tp % (q * q) == 0 and tp // (q * q) >= 2:
            out.append(("2.5d", tp // (q * q)))
        if "3d" in space.tp_modes and q**3 == tp:
            out.append(("3d", 1))
    return out


def _chunks(schedule: str, space: SearchSpace) -> tuple[int, ...]:
    if schedule == "interleaved-1f1b":
        return space.interleaved_vp
    return (2,) if schedule == "zb-h1" or schedule in V_SHAPED else (1,)


def evaluate(
    model_argv: list[str],
    layout: Layout,
    cluster: Cluster,
    *,
    vocab_size: int,
    global_batch_size: int,
    extra: list[str] = (),
    parser=None,
    time_misfits: bool = True,
    memo: dict | None = None,
) -> Candidate:
    """``layout`` validated, its memory predicted and (if it fits, or ``time_misfits``) its step
    time; ``parser``: a ``build_parser()`` to reuse, ``memo``: ``predict_memory``'s, kept for
    one model."""
    try:
        cfg, argv = validate(
            model_argv,
            layout,
            vocab_size=vocab_size,
            global_batch_size=global_batch_size,
            extra=extra,
            parser=parser,
        )
    except ValueError as e:
        return Candidate(layout, [], error=str(e).splitlines()[0])
    precision = cfg.model.precision_name
    par = cfg.parallel
    memory = predict_memory(
        cfg.model,
        layout,
        global_batch_size=global_batch_size,
        precision=precision,
        bucket_size=par.bucket_size(layout.dp),
        grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        device=cluster.device,
        memo=memo,
    )
    cand = Candidate(layout, argv, memory=memory, model=cfg.model)
    cand.fits = cand.peak_bytes <= cluster.usable_bytes
    if cand.fits or time_misfits:
        cand.step = predict_step_time(
            cfg.model,
            layout,
            cluster,
            global_batch_size=global_batch_size,
            precision=precision,
            overlap_grad_reduce=par.overlap_grad_reduce,
            grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        )
    return cand


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fit, best first
    rejected: list[Candidate]  # refused by validation or too big
    dominated: int = 0  # not evaluated: the same layout fits with less recompute


def lighter(a: str | None, b: str | None) -> bool:
    """Recompute ``a`` redoes a strict subset of what ``b`` redoes (so ``b`` only adds compute
    and traffic to ``a``): none < selective < full, none < block N < block M (N < M) < full."""
    if a == b or b is None:
        return False
    if a is None or b == "full":
        return True
    if not (a.startswith("block") and b.startswith("block")):
        return False
    return int(a.removeprefix("block")) < int(b.removeprefix("block"))


def recompute_rank(x: str | None) -> int:
    """A total order consistent with ``lighter``: lighter recompute is evaluated first."""
    if x is None:
        return 0
    if x == "full":
        return 1000
    return 1 if x == "selective" else int(x.removeprefix("block"))


@functools.lru_cache(maxsize=1)
def shared_parser():
    """One ``build_parser()`` per process for every validation: a parse leaves nothing in it,
    and building one costs as much as a few parses."""
    return build_parser()


PARALLEL_FROM = 2000  # candidates: below this, worker start-up costs more than it saves


@dataclass
class _Evaluator:
    """Evaluates one (TP, PP, CP, EP, DP) family's layouts at a time, with the memo and the
    recompute dominance that only hold inside a family (picklable: a worker process runs it)."""

    model_argv: list[str]
    cluster: Cluster
    vocab_size: int
    global_batch_size: int
    extra: list[str]
    exhaustive: bool

    def family(self, layouts: list[Layout]) -> SearchResult:
        parser, memo, out = shared_parser(), {}, SearchResult([], [])
        fitting: dict[Layout, list] = {}  # layout without recompute -> the recomputes that fit
        for layout in sorted(layouts, key=lambda x: recompute_rank(x.recompute)):
            base = replace(layout, recompute=None)
            if not self.exhaustive and any(
                lighter(r, layout.recompute) for r in fitting.get(base, [])
            ):
                out.dominated += 1
                continue
            cand = evaluate(
                self.model_argv,
                layout,
                self.cluster,
                vocab_size=self.vocab_size,
                global_batch_size=self.global_batch_size,
                extra=self.extra,
                parser=parser,
                time_misfits=False,
                memo=memo,
            )
            if cand.error is None and cand.fits:
                out.ranked.append(cand)
                fitting.setdefault(base, []).append(layout.recompute)
            else:
                out.rejected.append(cand)
        return out


def search(
    model_argv: list[str],
    cluster: Cluster,
    *,
    vocab_size: int,
    global_batch_size: int,
    extra: list[str] = (),
    layouts: list[Layout] | None = None,
    space: SearchSpace = SearchSpace(),
    exhaustive: bool = False,
    jobs: int = 1,
) -> SearchResult:
    """Rank ``layouts`` (default: ``candidate_layouts`` of ``space`` for this model), one family
    at a time, on ``jobs`` worker processes when there are many; the result does not depend on
    ``jobs`` (ties keep the candidates' order)."""
    if layouts is None:
        cfg, _ = validate(
            model_argv, Layout(), vocab_size=vocab_size, global_batch_size=1, extra=extra
        )
        layouts = candidate_layouts(
            cluster,
            global_batch_size=global_batch_size,
            seq_length=cfg.model.seq_length,
            num_experts=cfg.model.num_experts or 0,
            space=space,
        )
    order = {layout: i for i, layout in enumerate(layouts)}
    families: dict[tuple, list[Layout]] = {}
    for layout in layouts:
        families.setdefault(family_of(layout), []).append(layout)
    evaluator = _Evaluator(
        list(model_argv), cluster, vocab_size, global_batch_size, list(extra), exhaustive
    )
    if jobs > 1 and len(layouts) >= PARALLEL_FROM and len(families) > 1:
        # spawn, not fork: the caller may hold torch's threads
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(families))) as pool:
            parts = pool.map(evaluator.family, list(families.values()), chunksize=1)
    else:
        parts = [evaluator.family(f) for f in families.values()]
    result = SearchResult([], [])
    for part in parts:
        result.ranked += part.ranked
        result.rejected += part.rejected
        result.dominated += part.dominated
    result.ranked.sort(key=lambda c: (-c.step.tokens_per_s, order[c.layout]))
    result.rejected.sort(key=lambda c: order[c.layout])
    return result
