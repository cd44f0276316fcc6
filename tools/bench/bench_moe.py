"""Mixture-of-experts benchmarks (CPU, gloo), every figure a ratio measured in the same run.

    python tools/bench/bench_moe.py [--repeats 7] [--tiny] [--device cuda --dtype bfloat16]

1. The experts alone, forward + backward, median over repeats, with balanced routing and with
   70% of the tokens sent to one expert: the per-expert loop over each expert's routed rows,
   ``grouped_gemm`` (``torch._grouped_mm`` where it is a fused kernel, else the same loop) and the
   padded ``torch.bmm`` (every expert padded to the busiest one's count: the baseline): time
   against the loop, saved activations (saved-tensor hooks) and the peak over the step against
   the loop's (CUDA: the allocator's; CPU: ``LivePeak``, the bytes of every op's outputs alive).
   ``--device cuda --dtype bfloat16 --experts-only`` runs this part on a GPU.
2. The all-to-all against the allgather dispatcher: one MoE layer forward + backward on 4 gloo
   ranks (EP 4; ``--tiny``: 2 ranks, EP 2), median step time, and the bytes each rank sends,
   counted at the collectives (``all_to_all_single``, all-gather, reduce-scatter) beside the
   theory computed from the routing: all-to-all moves each routed copy of a token that leaves its
   rank four times (dispatch and combine, forward and backward) plus the counts; allgather moves
   every token to every rank.
3. Step time of a GPT model with MoE layers (8 experts, top-2) against a dense model of equal
   active parameters (ffn = 2 x the expert ffn), one process, forward + backward, median.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.moe import MoEConfig, MoELayer  # noqa: E402
from megalite.core.moe.experts import GroupedExperts, grouped_mm_serves  # noqa: E402
from megalite.core.parallel_state import ParallelState, initialize_model_parallel  # noqa: E402
from megalite.core.tensor_parallel.init import init_normal  # noqa: E402
from megalite.measure.live_bytes import LivePeak  # noqa: E402
from megalite.measure.saved_tensors import SavedTensorMeter  # noqa: E402
from megalite.models.config import GPTConfig  # noqa: E402
from megalite.models.gpt import GPTModel  # noqa: E402

MIB = 2**20


def _median_time(fn, repeats: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _init(key: str):
    return init_normal(0.02, seed=1, key=key)


# --- 1. experts: routed loop, grouped, padded bmm; balanced and skewed ------------------------


def routed_counts(tokens: int, experts: int, topk: int, skew: float | None) -> list[int]:
    """Rows per expert for ``tokens`` tokens choosing ``topk`` experts each: balanced (``skew``
    None), or ``skew`` of the tokens choosing expert 0 and the other choices spread evenly."""
    rows = tokens * topk
    if skew is None:
        counts = [rows // experts] * experts
    else:
        first = round(skew * tokens)
        rest = rows - first
        counts = [first] + [rest // (experts - 1)] * (experts - 1)
    counts[-1] += rows - sum(counts)
    return counts


def padded_bmm(layer: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The baseline: each expert's rows padded to the busiest expert's count, one ``torch.bmm``
    per linear (what the experts ran before they followed the routing)."""
    n, w1, w2 = len(counts), layer.weight1, layer.weight2
    counts_t = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(n, device=x.device), counts_t)  # [N]
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(n, max(counts), x.shape[1]).index_put((expert, slot), x)
    y = layer._activation(torch.bmm(padded, w1.transpose(1, 2)))  # [E, max_n, f1]
    return torch.bmm(y, w2.transpose(1, 2))[expert, slot]  # [N, h]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_experts(
    h: int,
    f: int,
    experts: int,
    tokens: int,
    repeats: int,
    *,
    skew: float | None,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """{path: (median seconds, saved-activation bytes, peak bytes)} of one
    forward + backward of the experts alone (SwiGLU, top-2)."""
    counts = routed_counts(tokens, experts, 2, skew)
    x = torch.randn(sum(counts), h, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    out = {}
    for name in ("loop", "grouped", "padded bmm"):
        cfg = MoEConfig(
            num_experts=experts,
            hidden_size=h,
            ffn_hidden_size=f,
            swiglu=True,
            grouped_gemm=name == "grouped",
            params_dtype=dtype,
        )
        layer = GroupedExperts(
            cfg,
            ep_rank=0,
            ep_size=1,
            etp_group=None,
            init_fc1=lambda e: _init(f"fc1.{e}"),
            init_fc2=lambda e: _init(f"fc2.{e}"),
            device=device,
        )
        run = (
            (lambda xi, layer=layer: padded_bmm(layer, xi, counts))
            if name == "padded bmm"
            else (lambda xi, layer=layer: layer(xi, counts))
        )

        def step(run=run):
            xi = x.clone().requires_grad_()
            run(xi).backward(dy)
            _sync(device)

        with SavedTensorMeter([x, *layer.parameters()]) as meter:
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step()
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            with LivePeak() as live:
                step()
            peak = live.peak
        out[name] = (_median_time(step, repeats), meter.peak, peak)
    w = torch.empty(experts, 2 * f, h, device=device, dtype=dtype)
    v = torch.empty(experts, h, f, device=device, dtype=dtype)
    out["grouped is torch._grouped_mm"] = grouped_mm_serves(x, w, v)
    return out


def print_experts(h: int, f: int, experts: int, tokens: int, repeats: int, device, dtype) -> None:
    print(
        f"experts fwd+bwd, {experts} experts top-2 SwiGLU, {tokens} tokens, h {h}, f {f}, "
        f"{str(dtype).removeprefix('torch.')} on {device}, median of {repeats}; saved = the "
        "activations autograd keeps (saved-tensor hooks); peak = the most bytes alive during "
        f"the step ({'the allocator' if device.type == 'cuda' else 'LivePeak, every op output'})"
    )
    header = f"{'routing':18s} {'path':11s} {'ms':>9s} {'/ loop':>7s} {'saved MiB':>10s}"
    print(f"{header} {'peak MiB':>9s} {'/ loop':>7s}")
    for skew in (None, 0.7):
        r = bench_experts(h, f, experts, tokens, repeats, skew=skew, device=device, dtype=dtype)
        label = "balanced" if skew is None else f"skewed ({skew:.0%} to 1)"
        loop, loop_peak = r["loop"][0], r["loop"][2]
        for name in ("loop", "grouped", "padded bmm"):
            secs, saved, peak = r[name]
            print(
                f"{label:18s} {name:11s} {secs * 1e3:9.2f} {secs / loop:7.2f} {saved / MIB:10.2f}"
                f" {peak / MIB:9.2f} {peak / loop_peak:7.2f}"
            )
    serves = r["grouped is torch._grouped_mm"]
    print(f"grouped = {'torch._grouped_mm' if serves else 'the loop (grouped_mm_serves: no)'}")


# --- 2. dispatchers on 4 ranks (--tiny: 2) ----------------------------------------------------


class ByteCounter:
    """Wraps the collectives the dispatchers use; ``sent`` = bytes leaving this rank."""

    def __init__(self):
        self.sent = 0
        self._saved = {}

    def __enter__(self):
        def a2a(orig):
            def wrapped(out, inp, out_splits=None, in_splits=None, group=None, **kw):
                n, me = dist.get_world_size(group), dist.get_rank(group)
                rows = list(in_splits) if in_splits else [inp.shape[0] // n] * n
                row = inp[0:1].numel() * inp.element_size() if inp.shape[0] else 0
                self.sent += sum(r for j, r in enumerate(rows) if j != me) * row
                return orig(out, inp, out_splits, in_splits, group=group, **kw)

            return wrapped

        def gather(orig):
            def wrapped(out, inp, group=None, **kw):
                n = dist.get_world_size(group)
                self.sent += (n - 1) * inp.numel() * inp.element_size()
                return orig(out, inp, group=group, **kw)

            return wrapped

        def scatter(orig):
            def wrapped(out, inp, group=None, **kw):
                n = dist.get_world_size(group)
                self.sent += (n - 1) * (inp.numel() // n) * inp.element_size()
                return orig(out, inp, group=group, **kw)

            return wrapped

        for name, wrap in (
            ("all_to_all_single", a2a),
            ("all_gather_single", gather),
            ("all_gather_into_tensor", gather),
            ("reduce_scatter_single", scatter),
            ("reduce_scatter_tensor", scatter),
        ):
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, wrap(self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def _dispatch_worker(rank, world, init_file, shape, repeats, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    h, f, experts, tokens = shape
    ps = initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, 1, h, generator=g)
    results = {}
    for kind in ("alltoall", "allgather"):
        cfg = MoEConfig(
            num_experts=experts,
            hidden_size=h,
            ffn_hidden_size=f,
            swiglu=True,
            grouped_gemm=True,
            token_dispatcher_type=kind,
        )
        layer = MoELayer(
            cfg,
            tp_group=None,
            seq_group=None,
            cp_size=1,
            ep_group=ps.group("ep"),
            ep_rank=ps.rank("ep"),
            etp_group=ps.group("etp"),
            expert_group=ps.group("etp", "ep"),
            sequence_parallel=False,
            init_router=_init("router"),
            init_fc1=lambda e: _init(f"fc1.{e}"),
            init_fc2=lambda e: _init(f"fc2.{e}"),
        )

        def step(layer=layer):
            xi = x.clone().requires_grad_()
            layer(xi).square().sum().backward()

        step()
        with ByteCounter() as counter:
            step()
        seconds = _median_time(step, repeats)
        # theory from the routing of these tokens
        with torch.no_grad():
            _, routing = layer.router(x.view(tokens, h), 1)
        row = h * 4
        el = experts // world
        if kind == "alltoall":
            per_rank = routing.sum(0).view(world, el).sum(1)  # copies to each EP rank
            sent_to = torch.zeros(world, world, dtype=torch.long)
            sent_to[rank] = per_rank
            dist.all_reduce(sent_to)
            out_rows = int(sent_to[rank].sum() - sent_to[rank, rank])
            in_rows = int(sent_to[:, rank].sum() - sent_to[rank, rank])
            theory = 2 * (out_rows + in_rows) * row + (world - 1) * el * 8  # + the counts
        else:
            fwd = (world - 1) * tokens * (h + 2 * experts) * 4 + (world - 1) * tokens * row
            bwd = (world - 1) * tokens * (h + experts) * 4 + (world - 1) * tokens * row
            theory = fwd + bwd
        results[kind] = (seconds, counter.sent, theory)
    queue.put((rank, results))
    ps.destroy()
    dist.destroy_process_group()


def bench_dispatchers(shape, repeats: int, world: int = 4) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    procs = [
        ctx.Process(target=_dispatch_worker, args=(r, world, init_file, shape, repeats, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return out


# --- 3. MoE vs dense of equal active parameters ----------------------------------------------


def bench_model(h: int, f: int, layers: int, seq: int, batch: int, repeats: int) -> dict:
    base = GPTConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=max(1, h // 64),
        vocab_size=1024,
        seq_length=seq,
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_fused_kernels=False,
    )
    configs = {
        "dense": dataclasses.replace(base, ffn_hidden_size=2 * f),
        "moe": dataclasses.replace(
            base,
            ffn_hidden_size=2 * f,
            num_experts=8,
            moe_ffn_hidden_size=f,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
            moe_aux_loss_coeff=1e-2,
        ),
    }
    tokens = torch.randint(0, 1024, (batch, seq))
    out = {}
    for name, cfg in configs.items():
        model = GPTModel(cfg, ParallelState.single())

        def step(model=model):
            model(tokens, None, labels=tokens).mean().backward()

        active = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
        if name == "moe":
            active += sum(p.numel() * 2 // 8 for n, p in model.named_parameters() if "experts" in n)
        out[name] = (_median_time(step, repeats), active)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--device", default="cpu", help="where part 1 (the experts) runs: cpu, cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--experts-only", action="store_true", help="part 1 alone (e.g. on a GPU)")
    p.add_argument("--experts-shape", help="part 1's h,f,tokens (default 256,512,2048)")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.tiny:
        h, f, tokens, layers, seq, repeats = 32, 64, 64, 1, 16, 1
    else:
        h, f, tokens, layers, seq, repeats = 256, 512, 2048, 2, 256, a.repeats
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    eh, ef, et = map(int, a.experts_shape.split(",")) if a.experts_shape else (h, f, tokens)
    print_experts(eh, ef, 8, et, repeats, device, dtype)
    if a.experts_only:
        return
    ep = 2 if a.tiny else 4  # a smoke run: the fewest ranks that send tokens to another
    d = bench_dispatchers((h, f, 8, tokens // ep), repeats, world=ep)
    differ = []  # dispatchers whose counted bytes are not the theory's: the run fails
    for kind in ("alltoall", "allgather"):
        secs = statistics.median(d[r][kind][0] for r in d)
        sent = [d[r][kind][1] for r in sorted(d)]
        theory = [d[r][kind][2] for r in sorted(d)]
        print(
            f"{kind:9s} EP{ep}, {tokens // ep} tokens per rank: step median {secs * 1e3:.2f} ms; "
            f"bytes sent per rank counted {sent} theory {theory} "
            f"({'equal' if sent == theory else 'DIFFER'})"
        )
        if sent != theory:
            differ.append(kind)
    a2a = statistics.median(d[r]["alltoall"][0] for r in d)
    ag = statistics.median(d[r]["allgather"][0] for r in d)
    print(f"alltoall / allgather step time = {a2a / ag:.2f}")
    m = bench_model(h, f, layers, seq, 4 if not a.tiny else 1, repeats)
    (t_dense, p_dense), (t_moe, p_moe) = m["dense"], m["moe"]
    print(
        f"GPT {layers} layers h {h}: dense (ffn {2 * f}) {t_dense * 1e3:.1f} ms, {p_dense} "
        f"params; MoE 8 x top-2 (ffn {f}) {t_moe * 1e3:.1f} ms, {p_moe} active params; "
        f"MoE / dense step time = {t_moe / t_dense:.2f}"
    )
    if differ:
        raise SystemExit(f"bytes sent differ from the theory: {', '.join(differ)}")


if __name__ == "__main__":
    main()
