"""Preprocessing throughput (documents/s, MB/s) with 1 and 2 workers, and its peak memory.

    python tools/bench/bench_data.py [--mb 100] [--sp-mb 25] [--repeats 3] [--tokenizers null sp]
    python tools/bench/bench_data.py --tiny     # seconds: 0.5 MB, NullTokenizer, 1 repeat, 1 size

Inputs are generated under /tmp/megalite_bench_data (reused between runs, never committed):
integer-id documents (--mb MB) for the NullTokenizer and pseudo-word text (--sp-mb MB) for a
SentencePiece BPE model (8k vocab) trained on it. Baseline, measured in the same run: the tokenizer
alone on the same documents in this process (texts already in memory, no JSON parsing, no writing).
``ratio vs baseline`` is the end-to-end rate over the bare tokenizer's: below 1 with one worker
(parsing and writing cost), up to about 2 with two workers on two idle cores. The three are run in
rotation --repeats times and medians are quoted.

Memory: tools/preprocess_data.py runs in a fresh process (--workers 2) on inputs of --mb / 2, --mb
and 2 x --mb MB while this script samples the RSS of it and its workers; the peaks should not grow
with the input.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_data_common import write_corpus, write_id_corpus  # noqa: E402

from megalite.data.null_tokenizer import NullTokenizer  # noqa: E402
from megalite.data.preprocess import preprocess_jsonl  # noqa: E402
from megalite.data.sentencepiece_tokenizer import SentencePieceTokenizer  # noqa: E402
from megalite.data.tokenizer_training import train_sentencepiece  # noqa: E402

ROOT = "/tmp/megalite_bench_data"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def throughput(name: str, path: str, tokenizer, repeats: int) -> None:
    """Baseline, --workers 1 and --workers 2 in rotation, so load changes hit all three alike."""
    mb = os.path.getsize(path) / 1e6
    texts = _texts(path)
    docs = len(texts)

    def baseline():
        for i in range(0, docs, 512):
            tokenizer.tokenize_batch(texts[i : i + 512])

    def pipeline(workers):
        preprocess_jsonl(
            path,
            f"{ROOT}/out_{name}",
            tokenizer,
            append_eod=True,
            workers=workers,
            log_interval=10**12,
        )

    runs = {"base": [], 1: [], 2: []}
    cpu = {"base": [], 1: [], 2: []}  # (main process, workers) CPU seconds: immune to other load
    for _ in range(repeats):
        for key, fn in (("base", baseline), (1, lambda: pipeline(1)), (2, lambda: pipeline(2))):
            me, kids = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            fn()
            runs[key].append(time.perf_counter() - t)
            cpu[key].append(
                (_cpu(resource.RUSAGE_SELF) - me, _cpu(resource.RUSAGE_CHILDREN) - kids)
            )
    b = statistics.median(runs["base"])
    print(f"\n{name}: {docs} documents, {mb:.1f} MB (medians of {repeats})")
    print(f"  baseline (tokenizer alone, 1 process): {docs / b:8.0f} docs/s {mb / b:7.2f} MB/s")
    for workers in (1, 2):
        m = statistics.median(runs[workers])
        times = ", ".join(f"{x:.1f}" for x in runs[workers])
        print(
            f"  preprocess --workers {workers}:            {docs / m:8.0f} docs/s {mb / m:7.2f} "
            f"MB/s  ratio vs baseline {b / m:5.2f}  (runs: {times} s)"
        )
    base_cpu = statistics.median(c[0] for c in cpu["base"])
    print(f"  CPU seconds (median): baseline {base_cpu:.1f}")
    for workers in (1, 2):
        main_cpu = statistics.median(c[0] for c in cpu[workers])
        worker_cpu = statistics.median(c[1] for c in cpu[workers])
        # on `workers` idle cores the run takes about max(main, workers' CPU / workers)
        bound = max(main_cpu, worker_cpu / workers) if workers > 1 else main_cpu + worker_cpu
        print(
            f"    --workers {workers}: main {main_cpu:.1f}, workers {worker_cpu:.1f} -> on idle "
            f"cores ~{bound:.1f} s, {mb / bound:.2f} MB/s, ratio vs baseline {base_cpu / bound:.2f}"
        )


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def peak_rss(path: str, extra: list[str]) -> tuple[float, float, float]:
    """Run the tool and sample RSS every 20 ms: peaks of the main process, the largest worker and
    the sum (the sum counts pages a forked worker shares with the main process twice)."""
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    cmd = [sys.executable, tool, "--input", path, "--output-prefix", f"{ROOT}/rss"]
    cmd += ["--workers", "2", "--append-eod", "--log-interval", str(10**12), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    main_peak = worker_peak = total_peak = 0.0
    while proc.poll() is None:
        main = _rss_mib(proc.pid)
        workers = [_rss_mib(c) for c in _children(proc.pid)]
        main_peak = max(main_peak, main)
        worker_peak = max([worker_peak, *workers])
        total_peak = max(total_peak, main + sum(workers))
        time.sleep(0.02)
    assert proc.returncode == 0, proc.returncode
    return main_peak, worker_peak, total_peak


def memory(mb: float, scales: tuple[float, ...] = (0.5, 1, 2)) -> None:
    """Peak RSS of the tool on inputs of ``mb`` times each of ``scales`` MB."""
    print("\npeak RSS of tools/preprocess_data.py --workers 2 (NullTokenizer), MiB:")
    for size in (mb * k for k in scales):
        path = write_id_corpus(f"{ROOT}/ids_{size:g}mb.jsonl", size)
        main_mib, worker_mib, total = peak_rss(
            path, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50000"]
        )
        real = os.path.getsize(path) / 1e6
        print(
            f"  input {real:6.1f} MB: main {main_mib:6.1f}  largest worker {worker_mib:6.1f}  "
            f"all processes {total:6.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=100)
    p.add_argument("--sp-mb", type=float, default=25, help="SentencePiece input size (slower)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokenizers", nargs="+", default=["null", "sp"], choices=["null", "sp"])
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument(
        "--tiny", action="store_true", help="a smoke run: 0.5 MB, NullTokenizer, one memory size"
    )
    args = p.parse_args()
    if args.tiny:
        args.mb, args.repeats, args.tokenizers = 0.5, 1, ["null"]
    os.makedirs(ROOT, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if "null" in args.tokenizers:
        path = write_id_corpus(f"{ROOT}/ids_{args.mb:g}mb.jsonl", args.mb)
        throughput("NullTokenizer", path, NullTokenizer(50000), args.repeats)
    if "sp" in args.tokenizers:
        path = write_corpus(f"{ROOT}/text_{args.sp_mb:g}mb.jsonl", args.sp_mb)
        model = f"{ROOT}/sp8k.model"
        if not os.path.exists(model):
            train_sentencepiece(
                [path], model[: -len(".model")], vocab_size=8000, input_sentence_size=20000
            )
        throughput("SentencePiece", path, SentencePieceTokenizer(model), args.repeats)
    if not args.skip_memory:
        memory(args.mb, (1,) if args.tiny else (0.5, 1, 2))


if __name__ == "__main__":
    main()
