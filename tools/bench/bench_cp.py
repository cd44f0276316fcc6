"""Context parallel on CPU: step time, saved activations, bytes moved and overlap at a long
sequence, CP 1, 2, 4 x comm types (p2p ring, a2a, all_gather), gloo processes.

    python tools/bench/bench_cp.py [--seq-length 8192] [--cp 1 2 4] [--steps 3] [--rounds 3]
    python tools/bench/bench_cp.py --tiny      # seq 64, CP 1 and 2: a smoke test

Model: a Llama-style GPTModel (RoPE, GQA: 8 heads in 4 groups of d = 16, hidden 128, 2 layers,
SwiGLU), one sequence of ``--seq-length`` tokens, fp32. A step is forward + loss + backward (no
optimizer: CP shards no parameter, so the update is CP1's). Per configuration, one world of CP
processes (one intra-op thread each; CP 1: this process) runs ``--steps`` timed steps per round for
``--rounds`` rounds; reported: the median over steps of the slowest rank's step time, its ratio to
CP1 in the same run, the bytes autograd saves per rank (saved-tensor hooks, storages once) and their
ratio to CP1, the bytes each rank sent per step counted at the collectives (``CommStats``) against
the comm type's formula (below; the script fails if they differ), and the seconds the rank spent
blocked in communication vs computing attention blocks (p2p: the ring's waits after its overlapped
send/recv; a2a and all_gather: the blocking collectives; a2a's attention is the ordinary kernel, not
timed apart).

Formulas, bytes sent per rank per step, per layer, with B the element size, ``c = b s/cp`` the
local tokens, ``KV = 2 c g d B`` the local K/V::

    p2p         forward (CP-1) KV; backward (CP-1) KV + CP KV (dK/dV accumulators, fp32)
    a2a         (CP-1)/CP x c d B x (2n + 2g') each way (q, k, v, out; g' = g if g % CP == 0 else n)
    all_gather  forward (CP-1) KV (all-gather); backward (CP-1) KV (reduce-scatter)

On two shared CPU cores, CP 4 runs 4 processes on 2 cores: its step times measure the design's
overheads, not a speed-up (CP's win on a real cluster is memory and the per-GPU attention FLOPs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.context_parallel import CommStats, cp_token_indices, split_for_cp  # noqa: E402
from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, VOCAB = 2, 128, 8, 4, 512


def model_config(seq_length: int, comm_type: str) -> GPTConfig:
    return GPTConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=2 * HIDDEN,
        vocab_size=VOCAB,
        seq_length=seq_length,
        max_position_embeddings=seq_length,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cp_comm_type=comm_type,
        use_fused_kernels=False,
    )


def expected_bytes(comm_type: str, cp: int, seq_length: int, *, elem: int = 4) -> int:
    """The formula of the module docstring, for the whole model (b = 1)."""
    if cp == 1:
        return 0
    d = HIDDEN // HEADS
    c = seq_length // cp
    kv = 2 * c * GROUPS * d * elem
    if comm_type == "p2p":
        per_layer = (cp - 1) * kv + (cp - 1) * kv + cp * kv
    elif comm_type == "all_gather":
        per_layer = 2 * (cp - 1) * kv
    else:
        g = GROUPS if GROUPS % cp == 0 else HEADS
        per_layer = 2 * (cp - 1) * c * d * elem * (2 * HEADS + 2 * g) // cp
    return LAYERS * per_layer


def saved_bytes(model, *inputs) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs[:2], labels=inputs[2])
    return sum(seen.values())


def _in_world(rank, world, init_file, args, comm_types) -> dict:
    """``{comm type: figures}``, every comm type of ``comm_types`` in turn, in this one world."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ps = initialize_model_parallel(1, 1, context_parallel_size=world)
    results = {c: measure(ps, c, args) for c in comm_types}
    ps.destroy()
    dist.destroy_process_group()
    return results


def _worker(rank, world, init_file, args, comm_types, queue) -> None:
    """A spawned rank of ``_in_world``; rank 0 puts the figures."""
    results = _in_world(rank, world, init_file, args, comm_types)
    if rank == 0:
        queue.put(results)


def measure(ps, comm_type: str, args) -> dict:
    """Step time, waits, attention compute, bytes sent and saved activations of ``comm_type``."""
    world, rank = ps.size("cp"), ps.rank("cp")
    s = args.seq_length
    model = GPTModel(model_config(s, comm_type), ps)
    stats = CommStats()
    for layer in model.decoder.layers:
        layer.self_attention.cp_stats = stats
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (1, s), generator=g) for _ in range(2))
    inputs = (
        split_for_cp(tokens, 1, world, rank),
        cp_token_indices(s, world, rank).unsqueeze(0),
        split_for_cp(labels, 1, world, rank),
    )
    activations = saved_bytes(model, *inputs)

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        loss = model(*inputs[:2], labels=inputs[2]).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        t = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
        return t.item()

    if not args.tiny:  # warm-up
        step()
    times, waits, computes, sent = [], [], [], []
    for _ in range(args.rounds):
        for _ in range(args.steps):
            stats.reset()
            times.append(step())
            waits.append(stats.wait_s)
            computes.append(stats.compute_s)
            sent.append(stats.bytes_sent)
    return {
        "step_s": statistics.median(times),
        "wait_s": statistics.median(waits),
        "compute_s": statistics.median(computes),
        "bytes_sent": sent[-1],
        "activations": activations,
    }


def run(cp: int, comm_types: list[str], args) -> dict:
    """``{comm type: figures}`` from one fresh world of ``cp`` ranks (CP 1: this process, no
    worker to start)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        if cp == 1:
            return _in_world(0, 1, init_file, args, comm_types)
        mp.start_processes(
            _worker, args=(cp, init_file, args, comm_types, queue), nprocs=cp, start_method="spawn"
        )
    return queue.get()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--comm", nargs="+", default=["p2p", "a2a", "all_gather"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="seq 64, CP 1 2, one step: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_length, args.cp, args.steps, args.rounds = 64, [1, 2], 1, 1
    rows = []
    base = None
    for cp in args.cp:
        comms = ["-"] if cp == 1 else args.comm
        figures = run(cp, ["p2p" if comm == "-" else comm for comm in comms], args)
        for comm in comms:
            r = figures["p2p" if comm == "-" else comm]
            want = expected_bytes(comm, cp, args.seq_length)
            if r["bytes_sent"] != want:
                raise SystemExit(f"CP{cp} {comm}: sent {r['bytes_sent']} bytes, formula {want}")
            base = base or r
            rows.append((cp, comm, r))
    print(
        f"seq {args.seq_length}, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {GROUPS} "
        f"groups, fp32, median of {args.rounds} x {args.steps} steps (slowest rank)"
    )
    print(
        "| CP | comm | step s | vs CP1 | saved act. MiB/rank | vs CP1 | MiB sent/rank/step "
        "(= formula) | wait s | attn compute s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for cp, comm, r in rows:
        compute = f"{r['compute_s']:.3f}" if comm in ("p2p", "all_gather") else "-"
        print(
            f"| {cp} | {comm} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
            f"{r['activations'] / 2**20:.1f} | {r['activations'] / base['activations']:.3f} | "
            f"{r['bytes_sent'] / 2**20:.2f} | {r['wait_s']:.3f} | {compute} |"
        )


if __name__ == "__main__":
    main()
