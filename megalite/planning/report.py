"""Text tables of a plan: the ranking, and one layout's breakdown (memory per rank, step time)."""

from __future__ import annotations

import shlex

from megalite.planning.predict import RankMemory

GIB = 2**30
MIB = 2**20


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def ranking_table(candidates, top: int) -> list[str]:
    lines = [
        f"{'#':>3} {'layout':<44} {'tokens/s':>12} {'MFU%':>6} {'step s':>8} {'peak GiB':>9}",
    ]
    for i, c in enumerate(candidates[:top]):
        lines.append(
            f"{i + 1:>3} {c.layout.name():<44} {c.step.tokens_per_s:>12,.0f} {c.step.mfu:>6.1f} "
            f"{c.step.seconds:>8.3f} {_gib(c.peak_bytes):>9}"
        )
    return lines


def memory_table(memory: list[RankMemory], unit: float = GIB, unit_name: str = "GiB") -> list[str]:
    """Per pipeline rank on the device: params, grads, master, optimizer, activations (in
    flight), total; then, where state is offloaded, host and disk bytes (params, grads,
    optimizer state)."""
    lines = [
        f"{'pp rank':>7} {'params':>9} {'grads':>9} {'master':>9} {'optim':>9} "
        f"{'activ.':>9} {'in-flight':>9} {'total':>9}  ({unit_name}, device)"
    ]
    for r in memory:
        s, a = r.state, r.activations
        lines.append(
            f"{r.pp_rank:>7} {s.params / unit:>9.3f} {s.grads / unit:>9.3f} "
            f"{s.master / unit:>9.3f} {s.optimizer / unit:>9.3f} {a.peak / unit:>9.3f} "
            f"{a.in_flight:>9} {r.total / unit:>9.3f}"
        )
    off = [r.state for r in memory]
    if any(s.params_host + s.grads_host + s.host + s.params_disk + s.disk for s in off):
        lines.append(
            f"{'pp rank':>7} {'params':>9} {'grads':>9} {'optim':>9} {'params':>9} {'optim':>9}"
            f"  ({unit_name}: host, host, host, disk, disk)"
        )
        for r in memory:
            s = r.state
            lines.append(
                f"{r.pp_rank:>7} {s.params_host / unit:>9.3f} {s.grads_host / unit:>9.3f} "
                f"{s.host / unit:>9.3f} {s.params_disk / unit:>9.3f} {s.disk / unit:>9.3f}"
            )
    return lines


def step_table(step) -> list[str]:
    lines = [
        f"step {step.seconds:.4f} s = pipeline (compute {step.compute:.4f} s incl. exposed TP "
        f"{step.tp_comm:.4f} s, bubble {step.bubble:.4f} s, p2p {step.pp_comm:.2e} s/hop) + DP "
        f"{step.dp_comm:.4f} s + optimizer {step.optimizer:.4f} s + fixed {step.fixed:.4f} s"
        + (f" + offload {step.offload:.4f} s" if step.offload_by else "")
        + f"; {step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1f}%"
    ]
    if step.offload_by:  # the transfers' own seconds (the overlapped ones partly hidden)
        parts = ", ".join(f"{what} {s:.4f} s" for what, s in step.offload_by.items())
        lines.append(
            f"offload transfers per step: {parts} (PCIe / NVMe; {step.offload:.4f} s exposed)"
        )
    return lines


def breakdown(candidate) -> list[str]:
    lines = [f"layout {candidate.layout.name()}"]
    lines += ["  " + line for line in memory_table(candidate.memory)]
    lines += ["  " + line for line in step_table(candidate.step)]
    flags = [a for a in candidate.argv if a not in ("--mock-data",)]
    lines.append("  pretrain_gpt.py " + shlex.join(_without_validation_flags(flags)))
    return lines


def _without_validation_flags(argv: list[str]) -> list[str]:
    """The candidate's flags minus the placeholders validation needed (lr, iters, tokenizer)."""
    drop = {"--lr": 1, "--train-iters": 1, "--tokenizer-type": 1}
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a in drop:
            skip = drop[a]
            continue
        out.append(a)
    return out
