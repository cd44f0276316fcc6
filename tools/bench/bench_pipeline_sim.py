"""The simulator's predicted pipeline step vs the measured one, with real compute, every schedule.

    python tools/bench/bench_pipeline_sim.py [--pp 2 4] [--m 8] [--runs 5] [--cores N]
                                             [--timeline-dir docs/img] [--check] [--tiny]

One gloo process per pipeline rank (one thread each) runs a tiny GPT (megalite's ``GPTModel``:
8 transformer layers of h 128, seq 64, micro-batch 4, vocabulary 1024; ``--tiny``: 4 layers of
h 32) cut into chunks by ``build_gpt_chunks`` for each schedule (1f1b, gpipe, interleaved-1f1b
v 2, zb-h1, zb-h1 v 2, zbv, dualpipev), at ``--m`` micro-batches. Per schedule:

1. profiling step (``megalite.core.pipeline_parallel.profiling``): every rank in turn, alone,
   times F, I and W of each of its chunks (medians of 4 after a warm-up), so every global stage
   gets its own (F, I, W) -- the first holds the embedding, the last the output layer and the loss;
   the p2p latency is half a ping-pong of one activation between neighbours;
2. measured step: the executor runs the schedule's action list with a ``Timeline``; the step lasts
   from the earliest start to the latest end over the ranks (``perf_counter``: one clock per
   machine); ``--runs`` repetitions, the cases interleaved, medians reported;
3. predicted step: ``simulate`` replays the same action list at the profiled costs. When the
   machine has fewer cores than pipeline ranks (PP 4 on 2 CPU cores) it is told so
   (``cores=``): the ranks with work to do share the cores, each running at ``cores / runnable``
   of its speed while more ranks than cores are runnable -- without it the simulator, which
   assumes one device per rank, predicts about half the measured step at PP 4 on 2 cores.

Prints predicted / measured per schedule, median and [min, max] over the runs (``--check``: exit 1
unless all medians lie within 15%), the
"/1f1b" column (each run's ratio over the same run's 1F1B ratio, median: the load drifting between
the profiling and the step moves every schedule of a run alike, and this takes it out), the
"nominal" ratio (the machine's core count, no executor time: what the effective cores and the
executor's own time add), the measured bubble (receive waits and idle head / tail, as a share of
``pp x step``; median and [min, max] over the runs) beside the simulated one and
the textbook formula (``simulator.theory``, at F = I = W: real costs differ, so this only ranks the
schedules), and with ``--timeline-dir`` writes ``pipeline_sim_<schedule>.svg``: the predicted
timeline above the measured one (of the run whose ratio is the median), one row per rank.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.core.pipeline_parallel.actions import with_p2p  # noqa: E402
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining  # noqa: E402
from megalite.core.pipeline_parallel.generators import V_SHAPED, generate, layout_of  # noqa: E402
from megalite.core.pipeline_parallel.model_chunk import ModelChunk  # noqa: E402
from megalite.core.pipeline_parallel.p2p import P2PCommunicator  # noqa: E402
from megalite.core.pipeline_parallel.profiling import (  # noqa: E402
    executor_seconds_per_action,
    gather_stage_costs,
    p2p_latency,
    profile_chunk,
)
from megalite.core.pipeline_parallel.simulator import Costs, simulate, theory  # noqa: E402
from megalite.core.pipeline_parallel.timeline import Timeline, render_comparison_svg  # noqa: E402
from megalite.models import GPTConfig  # noqa: E402
from megalite.training.model_chunks import build_gpt_chunks  # noqa: E402
from tools.bench.bench_pipeline_all import process_context  # noqa: E402

CASES = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h1", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]
MODEL = dict(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=1024, seq_length=64)
TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)
MICRO_BATCH = 4
COMPUTE = ("forward", "backward", "backward-input", "backward-weight")


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    out = model(tokens, None, labels)
    return out, lambda per_token: (per_token.mean(), {})


def _batches(config, m: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (MICRO_BATCH, config.seq_length)
    return [
        (
            torch.randint(0, config.vocab_size, shape, generator=g),
            torch.randint(0, config.vocab_size, shape, generator=g),
        )
        for _ in range(m)
    ]


def measure(
    m: int,
    runs: int,
    model: dict | None = None,
    cases: list | None = None,
    per_case_cores: bool = True,
    window: float = 0.4,
) -> dict[str, object]:
    """Run on every rank of a gloo world of pp ranks (one pipeline over the world): profile and
    measure each case. Returns, identically on every rank, ``{"latency": s, "cases": {(schedule,
    v): {"stages": [[(F, I, W) per stage] per run], "runs": [[(start, end, spans) per rank] per
    run]}}}``: the stages are profiled again before every run (the machine's speed drifts).
    ``window``: the seconds of each effective-cores measurement (``_effective_cores``)."""
    torch.set_num_threads(1)
    cases = cases or CASES
    pp = dist.get_world_size()
    ps = initialize_model_parallel(1, pp)
    config = GPTConfig(**(model or MODEL), hidden_dropout=0.0, attention_dropout=0.0)
    shape = (config.seq_length, MICRO_BATCH, config.hidden_size)
    batches = _batches(config, m)
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=shape,
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
    )
    chunks, out, profiled = {}, {}, {}
    for schedule, v in cases:
        torch.manual_seed(0)
        chunks[(schedule, v)] = build_gpt_chunks(config, ps, schedule=schedule, num_chunks=v)
        out[(schedule, v)] = {"stages": [], "runs": [], "cores": [], "per_action": []}
        _step(schedule, v, chunks[(schedule, v)], p2p, batches, ps)  # warm-up
        # stage s holds the s-th block of layers in every layout: one profile per stage count
        profiled.setdefault(layout_of(schedule, pp, v).num_stages, (schedule, v))
    latency = p2p_latency(shape, ps.pp_ranks, group=ps.pp_group)
    for _ in range(runs):
        stages = {
            n: _profile(case, chunks[case], batches, shape, ps) for n, case in profiled.items()
        }
        first = cases[0]
        n = layout_of(first[0], pp, first[1]).num_stages
        cores = _effective_cores(first, chunks[first], batches, shape, ps, stages[n], window)
        per_action = _executor_overhead(first, chunks[first], p2p, batches, ps)
        for case in cases:
            if per_case_cores:  # the load drifts within a run: the cores just before each step
                n = layout_of(case[0], pp, case[1]).num_stages
                cores = _effective_cores(case, chunks[case], batches, shape, ps, stages[n], window)
            tl = Timeline()
            start, end = _step(*case, chunks[case], p2p, batches, ps, timeline=tl)
            everyone = [None] * pp
            dist.all_gather_object(everyone, (start, end, tl.spans), group=ps.pp_group)
            out[case]["runs"].append(everyone)
            out[case]["stages"].append(stages[layout_of(case[0], pp, case[1]).num_stages])
            out[case]["cores"].append(cores)
            out[case]["per_action"].append(per_action)
    ps.destroy()
    return {"latency": latency, "cases": out}


def _profile(case, chunks, batches, shape, ps) -> list[tuple[float, float, float]]:
    """(F, I, W) of every global stage, each rank timing its chunks alone in turn."""
    layout, mine = layout_of(case[0], ps.pp_size, case[1]), {}
    for turn in range(ps.pp_size):
        dist.barrier(group=ps.pp_group)
        if turn != ps.pp_rank:
            continue
        for c, chunk in enumerate(chunks):
            s = layout.stage(ps.pp_rank, c)
            mine[s] = _profile_stage(chunk, s, layout, batches, shape)
    dist.barrier(group=ps.pp_group)
    return gather_stage_costs(mine, ps.pp_group)


def _profile_stage(chunk, s, layout, batches, shape, **repeats) -> tuple[float, float, float]:
    """(F, I, W) of ``chunk``, which runs global stage ``s``."""
    first, loss = s == 0, s == layout.num_stages - 1
    data = itertools.cycle(batches)
    kwargs = dict(input_shape=shape, num_microbatches=len(batches), **repeats)
    return profile_chunk(chunk, _forward_step, data, first=first, loss=loss, **kwargs)


def _effective_cores(case, chunks, batches, shape, ps, stages, window=0.4) -> float:
    """How many cores the pipeline ranks get when all compute at once: every rank runs its
    chunks' F / I / W over and over for ``window`` seconds, all ranks together; the work done,
    counted at the profiled alone-costs ``stages``, per second, summed over ranks (at most pp).
    Below the machine's core count when the machine is loaded or processes thrash each other's
    caches; the nominal count when they run as fast as alone."""
    layout = layout_of(case[0], ps.pp_size, case[1])
    mine = [layout.stage(ps.pp_rank, c) for c in range(len(chunks))]
    unit = sum(sum(stages[s]) for s in mine)
    dist.barrier(group=ps.pp_group)
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < window:
        for chunk, s in zip(chunks, mine):
            _profile_stage(chunk, s, layout, batches, shape, repeats=1, warmup=0)
        done += 1
    rate = torch.tensor([done * unit / (time.perf_counter() - t0)])
    dist.all_reduce(rate, group=ps.pp_group)
    return min(float(ps.pp_size), float(rate))


def _executor_overhead(case, chunks, p2p, batches, ps) -> float:
    """The executor's own CPU time per action (``executor_seconds_per_action``: outside every
    compute span and receive wait) in short steps of ``case`` at m = pp, mean over ranks."""
    m = ps.pp_size
    layout = layout_of(case[0], ps.pp_size, case[1])
    compute = generate(case[0], pp_size=m, num_microbatches=m, num_chunks=case[1])
    n = len(with_p2p(compute, layout)[ps.pp_rank])

    def step(timeline):
        _step(*case, chunks, p2p, batches[:m], ps, timeline=timeline)

    mine = torch.tensor([executor_seconds_per_action(step, n)])
    dist.all_reduce(mine, group=ps.pp_group)
    return float(mine) / ps.pp_size


def _step(schedule, v, chunks, p2p, batches, ps, timeline=None) -> tuple[float, float]:
    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier(group=ps.pp_group)
    start = time.perf_counter()
    forward_backward_pipelining(
        schedule=schedule,
        forward_step_func=_forward_step,
        data_iterator=[iter(batches)] * len(chunks),
        model=[ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)],
        num_microbatches=len(batches),
        p2p=p2p,
        pp_rank=ps.pp_rank,
        pp_size=ps.pp_size,
        timeline=timeline,
    )
    return start, time.perf_counter()


def measured_bubble(run) -> float:
    """Share of ``pp x step`` the ranks wait for an activation or a grad (``recv`` spans) or idle
    before their first / after their last action; the executor's own time is not bubble."""
    t0, t1 = min(s for s, _, _ in run), max(e for _, e, _ in run)
    idle = 0.0
    for _, _, spans in run:
        idle += sum(e - s for label, s, e in spans if label.split()[0] == "recv")
        idle += min(s for _, s, _ in spans) - t0 + t1 - max(e for _, _, e in spans)
    return idle / (len(run) * (t1 - t0))


def _overhead(runs, lists) -> float:
    """Measured time per action outside every span (compute and receive waits), mean over ranks
    and runs: the executor's own work, stretched when ranks share cores."""
    per = [
        (e - s - sum(b - a for _, a, b in spans)) / len(lists[r])
        for run in runs
        for r, (s, e, spans) in enumerate(run)
    ]
    return statistics.mean(per)


def _stretch(runs, stages, layout) -> float:
    """Sum of the measured compute spans over the sum of their profiled costs (1: the step ran
    each action as fast as the profiling step did)."""
    got = want = 0.0
    for run, st in zip(runs, stages):
        for r, (_, _, spans) in enumerate(run):
            for label, a, b in spans:
                kind, _, ids = label.partition(" ")
                if kind not in COMPUTE:
                    continue
                f, i, w = st[layout.stage(r, int(ids.split(".")[1]))]
                want += {"forward": f, "backward": i + w, "backward-input": i}.get(kind, w)
                got += b - a
    return got / want


def compare(results: dict, m: int, cores: int | str | None) -> dict:
    """Per case: predicted and measured step (median over runs), their ratio, bubbles, and the
    spans to draw (predicted and measured, of the run whose ratio is the median)."""
    pp = len(next(iter(results["cases"].values()))["runs"][0])
    share = cores if isinstance(cores, int) and cores < pp else None
    rows = {}
    for (schedule, v), case in results["cases"].items():
        layout = layout_of(schedule, pp, v)
        lists = with_p2p(generate(schedule, pp_size=pp, num_microbatches=m, num_chunks=v), layout)
        if cores == "measured":
            shares, per_action = case["cores"], case["per_action"]
        else:
            shares, per_action = [share] * len(case["runs"]), [0.0] * len(case["runs"])
        sims = [
            simulate(
                lists,
                layout,
                Costs(stages=st, p2p=results["latency"], per_action=o),
                cores=None if c is None or c >= pp else max(1.0, c),  # the model needs 1 core
            )
            for st, c, o in zip(case["stages"], shares, per_action)
        ]
        steps = [max(e for _, e, _ in run) - min(s for s, _, _ in run) for run in case["runs"]]
        measured = statistics.median(steps)
        ratios = [sim.step_time / t for sim, t in zip(sims, steps)]
        ratio = statistics.median(ratios)
        k = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
        sim, mid = sims[k], case["runs"][k]  # the run of median ratio, drawn
        t0 = min(s for s, _, _ in mid)
        formula = theory(schedule, pp_size=pp, num_microbatches=m, num_chunks=v)
        rows[(schedule, v)] = {
            "predicted": statistics.median(x.step_time for x in sims),
            "measured": measured,
            "ratio": ratio,
            "ratios": ratios,
            "cores": statistics.median(shares) if shares[0] else None,
            "per_action": statistics.median(per_action),
            "overhead": _overhead(case["runs"], lists),
            "stretch": _stretch(case["runs"], case["stages"], layout),
            "bubbles_measured": [measured_bubble(r) for r in case["runs"]],
            "bubble_simulated": sim.bubble,
            "bubble_theory": formula["bubble"],
            "predicted_spans": sim.spans,
            "measured_spans": [[(lb, s - t0, e - t0) for lb, s, e in spans] for _, _, spans in mid],
        }
    base = next(iter(rows.values()))["ratios"]  # the first case's (1f1b) per-run ratios
    for row in rows.values():  # the machine's drift moves every case of a run alike: taken out
        row["bubble_measured"] = statistics.median(row["bubbles_measured"])
        row["relative"] = statistics.median(a / b for a, b in zip(row["ratios"], base))
    return rows


def _spread(values: list[float]) -> str:
    """The noise over runs: ``[min, max]``."""
    return f"[{min(values):.3f}, {max(values):.3f}]"


def _worker(rank, pp, init_file, args, q):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    try:
        results = measure(
            args.m,
            args.runs,
            TINY if args.tiny else MODEL,
            per_case_cores=args.per_case_cores and not args.tiny,
            window=0.05 if args.tiny else 0.4,  # a smoke run: every schedule runs, cheaply
        )
        if rank == 0:
            q.put(results)
    finally:
        dist.destroy_process_group()


def _run(pp: int, args) -> dict:
    ctx = process_context(args.tiny, torch_schedules=False)
    q = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    procs = [ctx.Process(target=_worker, args=(r, pp, init_file, args, q)) for r in range(pp)]
    for p in procs:
        p.start()
    while True:
        try:
            results = q.get(timeout=5)
            break
        except Exception:  # noqa: BLE001 - queue.Empty: notice a worker that died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"a benchmark worker of PP {pp} failed") from None
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="the machine's cores, for the 'nominal' column (default: this process's affinity)",
    )
    parser.add_argument("--timeline-dir", default=None, help="write the SVGs here (PP 4 only)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless all within 15%%")
    parser.add_argument("--raw", default=None, help="save the raw spans to RAW.pp<P>.pkl")
    parser.add_argument("--reuse", action="store_true", help="re-read --raw instead of running")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: tiny model, 1 run")
    parser.add_argument(
        "--cores-once-per-run",
        dest="per_case_cores",
        action="store_false",
        help="measure the effective cores once per run (before the first schedule), not before "
        "every schedule's step (the default: the load drifts within a run)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.runs, args.pp = 1, [2]
    model = TINY if args.tiny else MODEL
    bad = []
    for pp in args.pp:
        path = f"{args.raw}.pp{pp}.pkl" if args.raw else None
        if path and args.reuse and os.path.exists(path):
            with open(path, "rb") as f:
                results = pickle.load(f)
        else:
            results = _run(pp, args)
            if path:
                with open(path, "wb") as f:
                    pickle.dump(results, f)
        rows = compare(results, args.m, "measured")
        nominal = compare(results, args.m, args.cores)
        share = f"{args.cores} cores shared" if args.cores < pp else "a core per rank"
        first = next(iter(rows.values()))
        share += (
            f"; measured: {first['cores']:.2f} effective cores, executor "
            f"{first['per_action'] * 1e6:.0f} us/action (CPU)"
        )
        print(
            f"PP {pp}, m {args.m}, GPT {model['num_layers']} layers h {model['hidden_size']} seq "
            f"{model['seq_length']} micro-batch {MICRO_BATCH}; {share}; p2p "
            f"{results['latency'] * 1e6:.0f} us; medians of {args.runs} runs"
        )
        print(
            f"  {'schedule':22s} {'predicted':>10s} {'measured':>10s} {'ratio [min, max]':>20s}"
            f" {'nominal':>7s} {'/1f1b':>6s}   bubble: "
            f"{'measured [min, max]':>22s} {'simulated':>9s} {'formula':>7s}"
        )
        for (schedule, v), row in rows.items():
            name = schedule + (f" v{v}" if v > 1 and schedule not in V_SHAPED else "")
            print(
                f"  {name:22s} {row['predicted'] * 1e3:8.1f}ms {row['measured'] * 1e3:8.1f}ms "
                f"{row['ratio']:6.3f} {_spread(row['ratios']):>13s} "
                f"{nominal[(schedule, v)]['ratio']:7.3f} {row['relative']:6.3f}           "
                f"{row['bubble_measured']:8.3f} {_spread(row['bubbles_measured']):>13s} "
                f"{row['bubble_simulated']:9.3f} {row['bubble_theory']:7.3f}   overhead/action "
                f"{row['overhead'] * 1e6:5.0f} us, spans / profiled {row['stretch']:.2f}"
            )
            if abs(row["ratio"] - 1) > 0.15:
                bad.append(f"PP {pp} {name}: {row['ratio']:.3f}")
            if args.timeline_dir and pp == 4:
                os.makedirs(args.timeline_dir, exist_ok=True)
                path = os.path.join(args.timeline_dir, f"pipeline_sim_{schedule}.svg")
                vs = f", v {v}" if v > 1 else ""
                if schedule == "zb-h1" and v > 1:
                    continue  # one picture per schedule: zb-h1 at v 1
                with open(path, "w") as f:
                    f.write(
                        render_comparison_svg(
                            row["predicted_spans"],
                            row["measured_spans"],
                            f"{schedule}, PP {pp}, m {args.m}{vs} ({share})",
                        )
                    )
                print(f"    wrote {path}")
    if args.check and bad:
        raise SystemExit(f"predicted / measured outside [0.85, 1.15]: {', '.join(bad)}")


if __name__ == "__main__":
    main()
