"""Why each family of layouts ranks where it does (``tools/plan.py --explain``).

    for line in explain(result, cluster): print(line)

A family is a (TP and its mode, PP, CP, EP, DP) mesh; its line names its best fitting layout's
rank, or why none fits (the smallest layout's bytes, or pretrain_gpt.py's refusal). When a grid
or cube tensor-parallel mode ranks above every 1d layout, its line says why, in bytes per device
against 1d at the same TP (with sequence parallelism): what one layer sends per micro-batch, and
how much of it crosses nodes (``tp_modes``' spans), and what one layer keeps for backward.
"""

from __future__ import annotations

from dataclasses import replace

from megalite.planning.activations import layer_bytes
from megalite.planning.cluster import Cluster
from megalite.planning.model_state import DTYPE_BYTES
from megalite.planning.tp_modes import layer_comms
from megalite.planning.traffic import Comm

GB = 1e9
GIB = 2**30


def family_of(layout) -> tuple:
    """(TP, PP, CP, EP, DP, mode, depth): the mesh a layout runs on."""
    return (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp, layout.tp_mode, layout.tp_depth)


def family_name(fam: tuple) -> str:
    tp, pp, cp, ep, dp, mode, depth = fam
    tp_name = f"TP{tp}" + ("" if mode == "1d" else f"-{mode}") + (f"-d{depth}" if depth > 1 else "")
    return " ".join(
        [tp_name, f"PP{pp}", f"DP{dp}"] + [f"CP{cp}"] * (cp > 1) + [f"EP{ep}"] * (ep > 1)
    )


def _sent(comms: list[Comm], cluster: Cluster) -> tuple[float, float]:
    """(bytes one device sends in ring collectives, the part whose group spans nodes)."""
    share = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
    total = across = 0.0
    for x in comms:
        sent = share[x.op] * (x.n - 1) / x.n * x.nbytes * x.count
        total += sent
        across += sent if x.span > cluster.gpus_per_node else 0.0
    return total, across


def mode_against_1d(cand, cluster: Cluster) -> str:
    """Why a grid or cube layout beats 1d: one layer's bytes per device (sent per micro-batch,
    the part across nodes; kept for backward) under its mode and under 1d at the same TP."""
    layout, c = cand.layout, cand.model
    e, b, tp = DTYPE_BYTES[c.precision_name], layout.micro_batch_size, layout.tp
    mode = dict(mode=layout.tp_mode, tp=tp, depth=layout.tp_depth)
    sent, across = _sent(sum(layer_comms(c, **mode, micro_batch_size=b, e=e), []), cluster)
    one_d = dict(mode="1d", tp=tp)
    sent_1d, across_1d = _sent(sum(layer_comms(c, **one_d, micro_batch_size=b, e=e), []), cluster)
    kept = cand.memory[0].activations.per_layer
    kept_1d = layer_bytes(
        replace(c, sequence_parallel=tp > 1),
        tokens=c.seq_length * b,
        b=b,
        tp=tp,
        e=e,
        selective=c.recompute_granularity == "selective",
        mask_bytes=e if cluster.device == "cpu" else 1,
        cpu=cluster.device == "cpu",
    )
    return (
        f"{layout.tp_mode} beats 1d here: a layer sends {sent / GB:.3g} GB per device per "
        f"micro-batch, {across / GB:.3g} GB across nodes (1d TP{tp}: {sent_1d / GB:.3g} GB, "
        f"{across_1d / GB:.3g} GB across nodes) and keeps {kept / GIB:.3g} GiB for backward "
        f"(1d with SP: {kept_1d / GIB:.3g} GiB)"
    )


def explain(result, cluster: Cluster) -> list[str]:
    """One line per family (module docstring) of a ``search.SearchResult``."""
    lines = []
    families: dict[tuple, list] = {}
    for c in result.ranked + result.rejected:
        families.setdefault(family_of(c.layout), []).append(c)
    position = {id(c): i for i, c in enumerate(result.ranked)}
    best_1d = next((i for i, c in enumerate(result.ranked) if c.layout.tp_mode == "1d"), None)
    for fam in sorted(families, key=lambda f: (f[:5], f[5] != "1d", f[5], f[6])):
        cands = families[fam]
        name = family_name(fam)
        fitting = [c for c in cands if id(c) in position]
        if fitting:
            best = min(fitting, key=lambda c: position[id(c)])
            line = (
                f"{name}: best is #{position[id(best)] + 1} ({best.layout.name()}, "
                f"{best.step.tokens_per_s:,.0f} tokens/s)"
            )
            wins = best_1d is None or position[id(best)] < best_1d
            if best.layout.tp_mode != "1d" and wins:
                line += "; " + mode_against_1d(best, cluster)
                if best_1d is not None:
                    rival = result.ranked[best_1d]
                    line += (
                        f"; the best 1d layout is #{best_1d + 1} ({rival.layout.name()}, "
                        f"{rival.step.tokens_per_s:,.0f} tokens/s)"
                    )
                else:
                    line += "; no 1d layout fits"
            lines.append(line)
            continue
        valid = [c for c in cands if c.error is None]
        if not valid:
            lines.append(f"{name}: refused by pretrain_gpt.py: {cands[0].error}")
            continue
        smallest = min(valid, key=lambda c: c.peak_bytes)
        lines.append(
            f"{name}: does not fit: the smallest layout ({smallest.layout.name()}) needs "
            f"{smallest.peak_bytes / 2**30:.1f} GiB on its fullest rank, "
            f"{cluster.usable_bytes / 2**30:.1f} GiB usable per GPU"
        )
    return lines
