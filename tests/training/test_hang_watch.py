"""``--distributed-timeout-minutes`` given turns the op recorder and hang watchdog on with that
timeout (``--hang-watchdog`` with the default timeout); neither given leaves them off."""

from __future__ import annotations

from megalite.training.arguments import parse_args
from tests.training.common import BASE

ENV = {"WORLD_SIZE": "1"}


def test_the_timeout_flag_turns_the_watchdog_on():
    cases = {
        (): (False, 10.0),
        ("--distributed-timeout-minutes", "0.5"): (True, 0.5),
        ("--hang-watchdog",): (True, 10.0),
    }
    for flags, want in cases.items():
        p = parse_args([*BASE, *flags], ENV).parallel
        assert (p.hang_watchdog, p.distributed_timeout_minutes) == want, flags
