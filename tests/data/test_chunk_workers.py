"""``ChunkWorkers``: results in input order whatever the worker count, a worker's exception raised
in the parent, a dead worker named, and ending them never waits on a worker: not even one blocked
writing a result nobody reads (where ``multiprocessing.Pool.terminate`` can hang)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megalite.data.chunk_workers import ChunkWorkers


def _square_after(state, chunk):
    time.sleep(state * (chunk % 3))  # uneven times: results arrive out of order
    return chunk * chunk


def _fail_on_three(state, chunk):
    if chunk == 3:
        raise ValueError("chunk 3 is bad")
    return chunk


def _die_on_two(state, chunk):
    if chunk == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return chunk


def _big(state, chunk):
    return b"x" * state  # larger than a pipe holds: the worker blocks until it is read


@pytest.mark.parametrize("n", [1, 2, 3])
def test_results_come_in_input_order(n):
    with ChunkWorkers(n, _square_after, 0.01) as workers:
        assert list(workers.map(range(10))) == [i * i for i in range(10)]


def test_a_workers_exception_is_raised_in_the_parent():
    with ChunkWorkers(2, _fail_on_three, None) as workers:
        got = []
        with pytest.raises(ValueError, match="chunk 3 is bad"):
            for r in workers.map(range(6)):
                got.append(r)
    assert got == [0, 1, 2]


def test_a_dead_worker_is_an_error_with_its_exit_code():
    with ChunkWorkers(2, _die_on_two, None) as workers:
        with pytest.raises(RuntimeError, match=r"worker died \(exit code -9\)"):
            list(workers.map(range(4)))


def test_closing_never_waits_on_a_worker_blocked_writing():
    workers = ChunkWorkers(2, _big, 8 << 20)
    results = workers.map(range(4))
    next(results)  # both workers hold a chunk; the second blocks writing 8 MiB nobody reads
    procs = list(workers._procs)
    closing = threading.Thread(target=workers.close, daemon=True)
    closing.start()
    closing.join(timeout=60)  # a hang guard only: a kill takes milliseconds
    assert not closing.is_alive(), "close() waited on a worker"
    assert all(not p.is_alive() for p in procs)
