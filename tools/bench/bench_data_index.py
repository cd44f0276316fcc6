"""Index build times and dataset read rate, each against a baseline measured in the same run.

    python tools/bench/bench_data_index.py [--samples 10000000] [--repeats 3]
    python tools/bench/bench_data_index.py --tiny   # seconds: 20 k documents, 1 M tokens, 1 repeat

1. GPT sample/shuffle index for --samples samples (seq 1024, 5 M documents of 1..4095 tokens):
   the vectorised numpy build vs a plain Python loop walking documents (timed on 200 k samples
   and scaled), then saving and loading (checksummed) the cache entry.
2. Blending index (quota-exact EDF, Python loop) for 1 M samples vs the plain largest-deficit loop.
3. Samples/s read through the loader in training order (shuffled samples, micro-batches of 8,
   seq 2048) from a 100 M-token dataset in /tmp, vs reading the same number of random windows
   straight from a numpy memmap of the .bin (no index, plain collate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.data import index_cache  # noqa: E402
from megalite.data.gpt_dataset import GPTDataset  # noqa: E402
from megalite.data.index_builders import (  # noqa: E402
    build_blending_index,
    build_gpt_indices,
    build_sample_index,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megalite.data.samplers import MicroBatchSampler, make_loader  # noqa: E402

ROOT = "/tmp/megalite_bench_data"


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, out


def plain_sample_index(sizes, document_index, seq_length, num_samples):
    """The obvious loop: walk documents, emit (position, offset) every seq_length tokens."""
    out = [(0, 0)]
    pos, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length
        while remaining:
            avail = int(sizes[document_index[pos]]) - offset
            if avail > remaining:
                offset += remaining
                remaining = 0
            else:
                remaining -= avail
                pos += 1
                offset = 0
        out.append((pos, offset))
    return out


def largest_deficit(weights, size):
    w = [x / sum(weights) for x in weights]
    err = [0.0] * len(w)
    out = np.empty(size, dtype=np.int16)
    for i in range(size):
        for d in range(len(w)):
            err[d] += w[d]
        best = max(range(len(w)), key=err.__getitem__)
        err[best] -= 1.0
        out[i] = best
    return out


def bench_sample_index(
    num_samples: int, repeats: int, documents: int = 5_000_000, small: int = 200_000
) -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4096, size=documents).astype(np.int32)
    docs = np.arange(sizes.size)
    med, runs, arrays = _median_time(
        lambda: build_gpt_indices(sizes, docs, seq_length=1024, seed=1, num_samples=num_samples),
        repeats,
    )
    doc_index = arrays["document_index"]
    total = len(arrays["shuffle_index"])
    vec, _, vec_index = _median_time(
        lambda: build_sample_index(sizes, doc_index, seq_length=1024, num_samples=total), repeats
    )
    t = time.perf_counter()
    ref = plain_sample_index(sizes, doc_index, 1024, small)
    loop = (time.perf_counter() - t) / small * total
    assert [tuple(r) for r in vec_index[: small + 1].tolist()] == ref
    print(f"GPT indices, {total:,} samples (one epoch of {documents:,} documents, seq 1024):")
    print(
        f"  full build (document + sample + shuffle index): {med:6.2f} s (runs "
        f"{', '.join(f'{x:.2f}' for x in runs)})"
    )
    print(
        f"  sample index alone, vectorised: {vec:6.2f} s; plain Python loop (scaled from "
        f"{small:,}): {loop:6.1f} s -> speed-up {loop / vec:.1f}x"
    )
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        desc = {"kind": "Bench", "n": num_samples}
        t = time.perf_counter()
        index_cache.save(d, desc, arrays)
        saved = time.perf_counter() - t
        med_load, _, _ = _median_time(lambda: index_cache.try_load(d, desc, list(arrays)), repeats)
    print(f"  cache save {saved:.2f} s, load with checksums {med_load:.2f} s")


def bench_blending(repeats: int, size: int = 1_000_000) -> None:
    print(f"blending index, {size:,} samples:")
    for weights in ([0.3, 0.7], [1.0] * 10):
        med, _, _ = _median_time(lambda w=weights: build_blending_index(w, size), repeats)
        base, _, _ = _median_time(lambda w=weights: largest_deficit(w, size), repeats)
        print(
            f"  {len(weights):2d} datasets: quota EDF {med:5.2f} s, plain largest-deficit loop "
            f"{base:5.2f} s (ratio {base / med:.2f})"
        )


def _make_dataset(tokens: int) -> str:
    prefix = f"{ROOT}/read_{tokens}"
    if os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(ROOT, exist_ok=True)
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        done = 0
        while done < tokens:
            lengths = rng.integers(50, 3000, size=10_000)
            ids = rng.integers(0, 50000, size=int(lengths.sum()))
            b.add_documents(ids, lengths)
            done += ids.size
    return prefix


def bench_read(samples: int, repeats: int, tokens: int = 100_000_000) -> None:
    seq, mbs = 2048, 8
    prefix = _make_dataset(tokens)
    indexed = IndexedDataset(prefix)
    gpt = GPTDataset(
        indexed, (0, len(indexed)), num_samples=samples, seq_length=seq, seed=0, use_cache=False
    )

    def loader_pass(workers):
        sampler = MicroBatchSampler(
            total_samples=samples,
            consumed_samples=0,
            micro_batch_size=mbs,
            global_batch_size=mbs * 4,
            dp_rank=0,
            dp_size=1,
        )
        for _ in make_loader(gpt, sampler, eod=0, eod_mask_loss=False, num_workers=workers):
            pass

    raw = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    starts = np.random.default_rng(1).integers(0, raw.size - seq - 1, size=samples)

    def raw_pass():
        import torch

        for i in range(0, samples, mbs):
            batch = np.stack([raw[s : s + seq + 1].astype(np.int64) for s in starts[i : i + mbs]])
            t = torch.from_numpy(batch)
            _ = (t[:, :-1].contiguous(), t[:, 1:].contiguous())

    base, _, _ = _median_time(raw_pass, repeats)
    print(f"reading {samples:,} samples of {seq} + 1 tokens in training order (micro-batch {mbs}):")
    print(f"  baseline: random windows from a raw memmap: {samples / base:9.0f} samples/s")
    for workers in (0, 2):
        med, _, _ = _median_time(lambda w=workers: loader_pass(w), repeats)
        print(
            f"  loader, num_workers={workers}: {samples / med:9.0f} samples/s "
            f"({samples * seq / med / 1e6:.1f} M tokens/s), ratio vs baseline {base / med:.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--read-samples", type=int, default=8192)
    p.add_argument("--tiny", action="store_true", help="a smoke run: small sizes, 1 repeat")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if args.tiny:
        bench_sample_index(20_000, 1, documents=20_000, small=2_000)
        bench_blending(1, size=10_000)
        bench_read(64, 1, tokens=1_000_000)
        return
    bench_sample_index(args.samples, args.repeats)
    bench_blending(args.repeats)
    bench_read(args.read_samples, args.repeats)


if __name__ == "__main__":
    main()
