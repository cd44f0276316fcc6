"""A per-rank daemon thread that notices a rank stuck in one operation, has every rank publish its
op records to the rendezvous store, prints the explanation (``hang_report.py``) and ends the job.

    watchdog = HangWatchdog(RECORDER, timeout_s=600, store=store, rank=r, world_size=n)
    watchdog.start()
    with watchdog.guard():          # a communication error on this rank explains too
        train()
    watchdog.stop()

Stuck: the recorder's ``current`` op (a collective, a message waited on, or a pipeline action)
has lasted more than ``timeout_s``. The thread, not the main thread, does the rest, since the main
thread is blocked in the collective:
1. it adds one to ``<prefix>flag`` in the store (the first rank to do so also writes the reason)
   and publishes its snapshot under ``<prefix>rank<r>``. Every other rank whose current op has
   lasted a quarter of the timeout polls the flag (a rank running normally never touches the
   store) and publishes too;
2. it waits up to ``grace_s`` for every rank's snapshot; a rank missing then is named dead;
3. rank 0 (or, if rank 0 published nothing, the lowest rank that did) logs the report and sets
   ``<prefix>done``; the others wait for that (at most ``grace_s`` more);
4. ``exit_fn(1)`` (``os._exit``: the main thread cannot be unblocked).
A store that fails (its host died) leaves this rank's own records to report, alone.

``guard()`` does steps 1-4 from the main thread when a torch.distributed error (a peer closed its
connection, gloo's own timeout) leaves the block, after logging its traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist

from megalite.core.hang_report import explain
from megalite.core.op_record import OpRecorder

logger = logging.getLogger(__name__)


def default_grace_s(timeout_s: float) -> float:
    """How long ranks wait for each other's snapshots: half the timeout, within [5, 60] s."""
    return max(5.0, min(60.0, timeout_s / 2))


class HangWatchdog:
    """See the module docstring. ``write`` takes the report's lines (default: log them as
    errors); ``exit_fn`` ends the process (default ``os._exit``)."""

    def __init__(
        self,
        recorder: OpRecorder,
        *,
        timeout_s: float,
        store,
        rank: int,
        world_size: int,
        grace_s: float | None = None,
        prefix: str = "megalite/hang/",
        write: Callable[[list[str]], None] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.recorder, self.timeout_s, self.store = recorder, timeout_s, store
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.grace_s = default_grace_s(timeout_s) if grace_s is None else grace_s
        self.poll_s = min(5.0, max(0.1, timeout_s / 10))
        self.write = write or _log_lines
        self.exit_fn = exit_fn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._triggered = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="megalite-hang-watchdog")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 2 + 1)
            self._thread = None

    @contextlib.contextmanager
    def guard(self):
        """A torch.distributed error inside the block explains the job's state and ends it."""
        try:
            yield
        except (dist.DistError, RuntimeError) as exc:
            self.on_error(exc)
            raise

    def on_error(self, exc: BaseException) -> None:
        """Called with an exception that is leaving the guarded code: a torch.distributed error
        (a peer closed its connection, the backend's own timeout) explains the job's state and
        ends it; any other exception returns for the caller to re-raise."""
        is_comm = isinstance(exc, dist.DistError) or "gloo" in str(exc).lower()
        if not is_comm or self._thread is None:
            return
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        logger.error("rank %d: %s", self.rank, traceback.format_exc())
        self.trigger(f"rank {self.rank} failed in a collective: {type(exc).__name__}: {first}")

    # --- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            rec = self.recorder.current
            if rec is None:
                continue
            since = time.time() - (rec.t_wait or rec.t_begin)
            if since > self.timeout_s:
                self.trigger(
                    f"rank {self.rank} was in one operation for {since:.0f} s "
                    f"(timeout {self.timeout_s:g} s)"
                )
            elif since > self.timeout_s / 4 and self._flagged():
                self.trigger(None)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _flagged(self) -> bool:
        return self.store.add(self._key("flag"), 0) > 0

    def _get(self, name: str) -> str | None:
        key = self._key(name)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def trigger(self, reason: str | None) -> None:
        """Publish, wait for the others, report (one rank), exit. Runs once per process; a
        second caller (the main thread after the watchdog began) waits for the exit."""
        with self._lock:
            if self._triggered:
                while True:
                    time.sleep(1.0)
            self._triggered = True
        try:
            self._exchange_and_report(reason)
        except Exception as exc:  # noqa: BLE001 - the store is gone (its host died): say so, alone
            snap = {self.rank: self.recorder.snapshot()}
            why = f"{reason or 'another rank noticed a hang'}; the store failed ({exc})"
            self.write(explain(snap, world_size=self.world_size, reason=why, grace_s=0.0))
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_fn(1)

    def _exchange_and_report(self, reason: str | None) -> None:
        if self.store.add(self._key("flag"), 1) == 1 and reason:
            self.store.set(self._key("reason"), reason)
        self.store.set(self._key(f"rank{self.rank}"), json.dumps(self.recorder.snapshot()))
        keys = [self._key(f"rank{r}") for r in range(self.world_size)]
        deadline = time.time() + self.grace_s
        while time.time() < deadline and not self.store.check(keys):
            time.sleep(0.1)
        snaps = {r: self._get(f"rank{r}") for r in range(self.world_size)}
        snaps = {r: json.loads(s) if s is not None else None for r, s in snaps.items()}
        reporter = 0 if snaps[0] is not None else min(r for r, s in snaps.items() if s)
        if self.rank == reporter:
            lines = explain(
                snaps,
                world_size=self.world_size,
                reason=self._get("reason") or reason or "",
                grace_s=self.grace_s,
            )
            self.write(lines)
            self.store.set(self._key("done"), "1")
        else:
            deadline = time.time() + self.grace_s
            while time.time() < deadline and not self.store.check([self._key("done")]):
                time.sleep(0.1)


def _log_lines(lines: list[str]) -> None:
    for line in lines:
        logger.error("%s", line)
