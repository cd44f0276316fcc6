"""One collective or message as the planner counts it (``traffic``, ``tp_modes``).

A ``Comm`` is one op (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``p2p``)
over ``n`` ranks on a group spanning ``span`` consecutive global ranks (what decides its link:
``Cluster.link_gbps``), of ``nbytes`` (the full tensor as ``measure.comm_log.CommLog`` counts it:
an all-gather's output, a reduce-scatter's input, one message), ``count`` times.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Comm:
    op: str
    n: int
    nbytes: float
    span: int
    count: float = 1.0
    grad_reduction: bool = False  # a DP grad reduction: --overlap-grad-reduce hides it in backward
    overlapped: bool = False  # posted before compute, waited after it: the transfer alone
    synced: bool = False  # right after another on the same ranks: they arrive in step
    prefetched: bool = False  # ZeRO-3's gather of the next unit, started before this one computes
