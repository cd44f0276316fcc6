"""Explain a hang from every rank's last records (``OpRecorder.snapshot``): who waits for whom,
and the first operation where the ranks disagree. Pure: snapshots in, lines out.

    lines = explain({0: snap0, 1: snap1, 2: None}, world_size=3)

A rank's line says what it is in (its ``current`` record) and, for a message, what the peer is
in: "rank 1 (pp stage 1) waits to receive micro-batch 2's activation from rank 0, which is in the
backward of micro-batch 0". A rank whose snapshot is None published nothing: it is dead, or blocked
outside any recorded operation.

The first divergence compares what the ranks did on each channel, op by op, by sequence number
(see ``op_record.py``):
- a p2p channel (sender, receiver): the k-th send against the k-th receive; they must carry the
  same micro-batch, stage and kind (messages are posted in FIFO order on both ends). A receive
  waited on while the sender has posted fewer than k+1 sends (or a send waited on that was never
  received) is a divergence too;
- a process group: each member's k-th collective must be the same op on the same shape for the
  same purpose; a member waiting in its k-th while another has not entered it is a divergence.
The earliest one (by the time the first rank reached it) is reported.
"""

from __future__ import annotations

_ACTIONS = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def _who(rank: int, snap: dict | None) -> str:
    coords = snap["coords"] if snap else {}
    return f"rank {rank} (pp stage {coords['pp']})" if "pp" in coords else f"rank {rank}"


def _message(rec: dict) -> str:
    if rec["what"] not in ("activation", "grad"):  # the losses handed to the last stage
        return f"the {rec['what']}"
    kind = "activation" if rec["what"] == "activation" else "gradient"
    return f"micro-batch {rec['microbatch']}'s {kind} (stage {rec['stage']})"


def _during(rec: dict) -> str:
    if rec["action"] is None or rec["microbatch"] is None:
        return ""
    return f", during the {_ACTIONS[rec['action']]} of micro-batch {rec['microbatch']}"


def _collective(rec: dict) -> str:
    channel = rec["channel"]
    axis = f"{rec['axis']} " if rec["axis"] else ""
    what = f"{rec['what']}, " if rec["what"] else ""
    return (
        f"{rec['op']} #{rec['seq']} over {axis}ranks {list(channel[2:])} "
        f"({what}shape {rec['shape']})"
    )


def describe(rec: dict, now: float) -> str:
    """What a rank does in ``rec`` (its current record), as a verb phrase."""
    since = now - (rec["t_wait"] or rec["t_begin"])
    if rec["op"] == "compute":
        return (
            f"is in the {_ACTIONS[rec['action']]} of micro-batch {rec['microbatch']} "
            f"(stage {rec['stage']}) for {since:.0f} s"
        )
    if rec["op"] == "recv":
        return f"waits to receive {_message(rec)} from rank {rec['peer']} for {since:.0f} s"
    if rec["op"] == "send":
        return f"waits to send {_message(rec)} to rank {rec['peer']} for {since:.0f} s"
    return f"waits in {_collective(rec)}{_during(rec)} for {since:.0f} s"


def _current(snap: dict) -> dict | None:
    by_index = {r["index"]: r for r in snap["records"]}
    return by_index.get(snap["current"]) if snap["current"] is not None else None


def _state(rank: int, snaps: dict[int, dict | None]) -> str:
    """What ``rank`` is in, for the end of another rank's line."""
    snap = snaps.get(rank)
    if snap is None:
        return f"rank {rank} published nothing (dead?)"
    rec = _current(snap)
    if rec is None:
        return f"rank {rank} is between recorded operations"
    return f"rank {rank} {describe(rec, snap['now'])}"


def _wait_line(rank: int, snaps: dict[int, dict | None]) -> str:
    snap = snaps[rank]
    rec = _current(snap)
    if rec is None:
        last = snap["records"][-1] if snap["records"] else None
        tail = f"; its last was {last['op']} #{last['seq']}" if last else ""
        return f"{_who(rank, snap)} is between recorded operations{tail}"
    line = f"{_who(rank, snap)} {describe(rec, snap['now'])}"
    if rec["op"] in ("send", "recv"):
        peer = _state(rec["peer"], snaps).removeprefix(f"rank {rec['peer']} ")
        line += f", which {peer}"
    return line


# --- the first divergence ---------------------------------------------------------------------


def _by_channel(snaps: dict[int, dict | None]):
    """(channel, rank) -> {seq: record}, and (channel, rank) -> ops issued so far."""
    ops: dict[tuple, dict[int, dict]] = {}
    counts: dict[tuple, int] = {}
    for rank, snap in snaps.items():
        if snap is None:
            continue
        for rec in snap["records"]:
            ops.setdefault((tuple(rec["channel"]), rank), {})[rec["seq"]] = rec
        for channel, n in snap["counters"]:
            counts[(tuple(channel), rank)] = n
    return ops, counts


def rec_rank(rec: dict, src: int, dst: int) -> int:
    """The rank that made ``rec`` on the channel ``src`` -> ``dst``."""
    return src if rec["op"] == "send" else dst


def _p2p_signature(rec: dict) -> tuple:
    return (rec["what"], rec["microbatch"], rec["stage"])


def _p2p_divergences(channel, ops, counts, snaps):
    src, dst = channel[1], channel[2]
    sends, recvs = ops.get((channel, src), {}), ops.get((channel, dst), {})
    for mine, other in ((recvs, src), (sends, dst)):
        if snaps.get(other) is None:  # dead: what this end waits on will never come
            for k, rec in mine.items():
                waiter = rec_rank(rec, src, dst)
                if rec["state"] == "waiting":
                    yield (
                        rec["t_wait"],
                        f"{_who(waiter, snaps[waiter])} waits for {_message(rec)} "
                        f"(#{k} from rank {src} to rank {dst}), and rank {other} published "
                        "nothing (dead?)",
                    )
            return
    for k in sorted(set(sends) & set(recvs)):
        s, r = sends[k], recvs[k]
        if _p2p_signature(s) != _p2p_signature(r):
            yield (
                min(s["t_begin"], r["t_begin"]),
                f"rank {src}'s send #{k} to rank {dst} is {_message(s)}, but rank {dst}'s "
                f"receive #{k} from rank {src} expects {_message(r)}",
            )
    for mine, other, waiting, verb in ((recvs, src, dst, "sent"), (sends, dst, src, "received")):
        issued = counts.get((channel, other), 0)
        for k, rec in mine.items():
            if rec["state"] == "waiting" and issued <= k:
                need = f"{_message(rec)} (#{k} from rank {src} to rank {dst})"
                yield (
                    rec["t_wait"],
                    f"rank {waiting} waits for {need}, which rank {other} has not {verb}: "
                    f"{_state(other, snaps)}",
                )


def _group_divergences(channel, ops, counts, snaps):
    members = [r for r in channel[2:] if snaps.get(r) is not None]
    seqs = sorted({k for m in members for k in ops.get((channel, m), {})})
    for k in seqs:
        have = {m: ops[(channel, m)][k] for m in members if k in ops.get((channel, m), {})}
        signatures = {m: (r["op"], tuple(r["shape"] or ()), r["what"]) for m, r in have.items()}
        if len(set(signatures.values())) > 1:
            listing = "; ".join(
                f"rank {m} entered {_collective(r)}{_during(r)}" for m, r in have.items()
            )
            yield min(r["t_begin"] for r in have.values()), f"the ranks disagree: {listing}"
            return
        waiting = [r for r in have.values() if r["state"] == "waiting"]
        absent = [m for m in channel[2:] if m not in members or counts.get((channel, m), 0) <= k]
        if waiting and absent:
            first = waiting[0]
            who = " and ".join(f"rank {m}" for m in sorted(have))
            yield (
                min(r["t_wait"] for r in waiting),
                f"{who} {'wait' if len(have) > 1 else 'waits'} in {_collective(first)}"
                f"{_during(first)}, which "
                + " and ".join(f"rank {m}" for m in absent)
                + " has not entered: "
                + "; ".join(_state(m, snaps) for m in absent),
            )
            return


def first_divergence(snaps: dict[int, dict | None]) -> str | None:
    """The earliest operation where the published ranks disagree, in words (None: no disagreement
    in what the rings still hold)."""
    ops, counts = _by_channel(snaps)
    found = []
    for channel in sorted({c for c, _ in ops}):
        if channel[0] == "p2p":
            found.extend(_p2p_divergences(channel, ops, counts, snaps))
        elif channel[0] == "group":
            found.extend(_group_divergences(channel, ops, counts, snaps))
    return min(found)[1] if found else None


def explain(
    snaps: dict[int, dict | None], *, world_size: int, reason: str = "", grace_s: float = 0.0
) -> list[str]:
    """The report's lines: the reason, one line per rank, the first divergence."""
    published = [r for r in range(world_size) if snaps.get(r) is not None]
    lines = [
        f"hang explainer: {reason or 'a rank waited too long'}; "
        f"{len(published)} of {world_size} ranks published their last operations"
    ]
    for rank in range(world_size):
        if snaps.get(rank) is None:
            lines.append(
                f"rank {rank} published nothing within {grace_s:.0f} s: dead, or blocked outside "
                "any recorded operation"
            )
        else:
            lines.append(_wait_line(rank, snaps))
    divergence = first_divergence(snaps)
    lines.append(
        f"first divergence: {divergence}"
        if divergence
        else "first divergence: none in the recorded operations"
    )
    return lines
