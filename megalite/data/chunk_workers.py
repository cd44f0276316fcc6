"""Worker processes that map a function over chunks, results in input order, and end by a kill.

    with ChunkWorkers(2, fn, state) as workers:      # fn(state, chunk) -> result, in a worker
        for result in workers.map(chunks):           # in the order of ``chunks``
            ...

Each worker has a pipe of its own and holds one chunk at a time: the parent sends a worker its
next chunk only after reading its result, so neither side can block on a full pipe while the
other waits for it, and no lock is shared. Ending them (``close``, on any exit of the ``with``)
kills every worker and closes its pipe: nothing waits on a worker, whatever it was doing.
``multiprocessing.Pool`` is not used because its ``terminate()`` puts a sentinel on the result
queue under that queue's write lock, and can wait forever for a worker blocked writing a result
that its (already stopped) result thread no longer reads: a SIGTERM in the middle of a run hung
``tools/preprocess_data.py`` that way.

A worker ignores SIGINT (the parent handles Ctrl-C and ends them) and takes SIGTERM's default
action. An exception in ``fn`` is re-raised in the parent; a worker that dies is an error naming
its exit code.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator


def _serve(conn, fn: Callable, state) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        try:
            reply = (True, fn(state, chunk))
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent
            reply = (False, e)
        conn.send(reply)


class ChunkWorkers:
    """``n`` processes running ``fn(state, chunk)`` (module docstring)."""

    def __init__(self, n: int, fn: Callable, state):
        if n < 1:
            raise ValueError(f"ChunkWorkers needs n >= 1, got {n}")
        self._procs, self._conns = [], []
        try:
            for _ in range(n):
                parent, child = mp.Pipe()
                proc = mp.Process(target=_serve, args=(child, fn, state), daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        except BaseException:
            self.close()
            raise

    def map(self, chunks: Iterable) -> Iterator:
        """``fn`` of each chunk, in the order of ``chunks``; one chunk per worker in flight."""
        chunks = iter(chunks)
        busy: deque = deque()  # workers holding a chunk, oldest first
        for i, conn in enumerate(self._conns):
            chunk = next(chunks, _END)
            if chunk is _END:
                break
            conn.send(chunk)
            busy.append(i)
        while busy:
            i = busy.popleft()
            ok, value = self._receive(i)
            chunk = next(chunks, _END)
            if chunk is not _END:  # keep the worker busy while the caller takes the result
                self._conns[i].send(chunk)
                busy.append(i)
            if not ok:
                raise value
            yield value

    def _receive(self, i: int):
        try:
            return self._conns[i].recv()
        except EOFError:
            self._procs[i].join(timeout=1.0)
            raise RuntimeError(
                f"a preprocessing worker died (exit code {self._procs[i].exitcode}) while it held "
                "a chunk: out of memory, or killed"
            ) from None

    def close(self) -> None:
        """Kill every worker and close its pipe (no wait on a worker's own progress)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> ChunkWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_END = object()
