"""MoE experts in checkpoints, keyed by GLOBAL expert index (DESIGN §5), so EP / ETP / PP reshard.

The dense shard files (``mp_rank_*``, written by DP rank 0) cannot hold the experts: under expert
parallelism the ranks of one dense DP group hold different experts. So every rank with edp rank 0
also writes its experts::

    SAVE/iter_0000500/experts/pp_{pp:03d}_ep_{ep:03d}_etp_{etp:02d}.pt
        {"layout": {"ep_size", "etp_size", "swiglu"},
         "model": {"decoder.layers.{L}.mlp.experts.{e}.linear_fc1.weight": # [f1/etp, h], ...},
         "optimizer": {same name: {"master", "exp_avg", "exp_avg_sq"}} or None}

with ``L`` the global layer and ``e`` the global expert; ``linear_fc1`` is ``[gate; up]`` split with
stride 2 over ETP under SwiGLU (like the dense MLP), ``linear_fc2`` # [h, f/etp]. Loading merges a
saved expert's ETP shards and cuts the run's, for whichever EP rank now holds it. The expert
optimizer state is written whole over edp whatever the ZeRO rung (a sharded optimizer's expert
buffers are gathered over edp first: ``gather_expert_optimizer``, a collective), so it resumes at
any EP / ETP / TP / DP layout; the ``distrib_optim`` files also hold the edp shards, which a
resume at the same layout reads directly.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from megalite.checkpoint.files import CheckpointError, load_file, save_file
from megalite.checkpoint.resharding import stage_of
from megalite.checkpoint.tp_shards import TPSplit, merge_tp, split_tp
from megalite.core.moe.experts import GroupedExperts
from megalite.core.optimizer.sharded_state_format import full_state_buffers
from megalite.core.parallel_state import ParallelState

EXPERTS_DIR = "experts"
_LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(weight[12])$")
_KINDS = {"weight1": "linear_fc1", "weight2": "linear_fc2"}


def is_expert_name(name: str) -> bool:
    """A stage-local state-dict name of stacked expert weights (kept out of the dense files'
    resharding)."""
    return _LOCAL.match(name) is not None


def _split(kind: str, swiglu: bool) -> TPSplit:
    return TPSplit(0, stride=2 if swiglu else 1) if kind == "weight1" else TPSplit(1)


def _expert_params(module: nn.Module) -> list[tuple[str, int, str, nn.Parameter]]:
    """(local name, global layer, kind, stacked parameter) of every expert weight of a stage."""
    offset = module.layer_range[0]
    out = []
    for name, p in module.named_parameters():
        m = _LOCAL.match(name)
        if m is not None:
            out.append((name, int(m.group(1)) + offset, m.group(2), p))
    return out


def has_experts(module: nn.Module) -> bool:
    return any(isinstance(m, GroupedExperts) for m in module.modules())


def _file(iter_dir: str, pp: int, ep: int, etp: int) -> str:
    return os.path.join(iter_dir, EXPERTS_DIR, f"pp_{pp:03d}_ep_{ep:03d}_etp_{etp:02d}.pt")


def gather_expert_optimizer(module: nn.Module, optimizer, ps: ParallelState) -> dict | None:
    """A sharded (ZeRO) optimizer's expert state, whole over edp: ``{local name: {"master",
    "exp_avg", "exp_avg_sq"}}``; a collective over edp, every rank calls it before
    ``expert_file``. None for a plain optimizer (``expert_file`` reads it itself) or without
    experts."""
    del ps
    if optimizer is None or not optimizer.is_sharded or not _expert_params(module):
        return None
    return full_state_buffers(optimizer, expert=True)


def expert_file(
    iter_dir: str, module: nn.Module, optimizer, ps: ParallelState, gathered: dict | None = None
) -> tuple[str, dict] | None:
    """(path, content) of this rank's expert file (edp rank 0 only; None on the others and
    without experts); the content's tensors are views of the live state.
    ``optimizer`` None: the model only (``--no-save-optim``); a sharded optimizer's state comes
    from ``gathered`` (``gather_expert_optimizer``)."""
    params = _expert_params(module)
    if not params or ps.rank("edp") != 0:
        return None
    el = params[0][3].shape[0]
    first = ps.rank("ep") * el
    full_optim = None
    if optimizer is not None and not optimizer.is_sharded:
        full_optim = optimizer.full_state_dict(copy=False)["params"]
    elif optimizer is not None:
        full_optim = gathered
    model, optim = {}, {} if full_optim is not None else None
    for local, layer, kind, p in params:
        for i in range(el):
            key = f"decoder.layers.{layer}.mlp.experts.{first + i}.{_KINDS[kind]}.weight"
            model[key] = p.detach()[i]
            if optim is not None:
                optim[key] = {k: v[i] for k, v in full_optim[local].items()}
    swiglu = any(m.swiglu for m in module.modules() if isinstance(m, GroupedExperts))
    record = {
        "layout": {"ep_size": ps.size("ep"), "etp_size": ps.size("etp"), "swiglu": swiglu},
        "model": model,
        "optimizer": optim,
    }
    return _file(iter_dir, ps.pp_rank, ps.rank("ep"), ps.rank("etp")), record


class ExpertReader:
    """The saved experts of one iteration, as each global expert's full logical tensors."""

    def __init__(self, iter_dir: str, layer_ranges: list[tuple[int, int]]):
        self.iter_dir, self.layer_ranges = iter_dir, layer_ranges
        folder = os.path.join(iter_dir, EXPERTS_DIR)
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if not names:
            raise CheckpointError(
                f"checkpoint {iter_dir} holds no {EXPERTS_DIR}/ files but this model has MoE "
                "experts; it was saved from another model (compare --num-experts)"
            )
        layout = load_file(os.path.join(folder, names[0]))["layout"]
        self.ep_size, self.etp_size = int(layout["ep_size"]), int(layout["etp_size"])
        self.swiglu = bool(layout["swiglu"])
        self._files: dict[tuple[int, int, int], dict] = {}

    def _shard(self, pp: int, ep: int, etp: int) -> dict:
        key = (pp, ep, etp)
        if key not in self._files:
            path = _file(self.iter_dir, pp, ep, etp)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint is incomplete: {path} is missing")
            self._files[key] = load_file(path)
        return self._files[key]

    def tensors(self, layer: int, expert: int, kind: str, num_experts: int) -> dict:
        """``{"model": full tensor, "optimizer": {master, exp_avg, exp_avg_sq} or None}``."""
        pp = stage_of(f"decoder.layers.{layer}.x", self.layer_ranges)
        ep = expert // (num_experts // self.ep_size)
        key = f"decoder.layers.{layer}.mlp.experts.{expert}.{_KINDS[kind]}.weight"
        shards = [self._shard(pp, ep, t) for t in range(self.etp_size)]
        split = _split(kind, self.swiglu)
        if any(key not in s["model"] for s in shards):
            raise CheckpointError(f"{self.iter_dir}: no {key} in the expert files")
        model = merge_tp([s["model"][key] for s in shards], split, vocab_size=0)
        optim = None
        if all(s["optimizer"] is not None for s in shards):
            optim = {
                k: merge_tp([s["optimizer"][key][k] for s in shards], split, vocab_size=0)
                for k in ("master", "exp_avg", "exp_avg_sq")
            }
        return {"model": model, "optimizer": optim}


def expert_states(
    reader: ExpertReader, module: nn.Module, ps: ParallelState, *, with_optimizer: bool
) -> tuple[dict, dict]:
    """(model state, optimizer ``params`` entries) of this rank's stacked expert weights, cut for
    its EP rank and ETP slice from the saved global experts."""
    params = _expert_params(module)
    etp, etp_rank = ps.size("etp"), ps.rank("etp")
    model, optim = {}, {}
    for local, layer, kind, p in params:
        el = p.shape[0]
        num_experts = el * ps.size("ep")
        first = ps.rank("ep") * el
        split = _split(kind, reader.swiglu)
        pieces = [reader.tensors(layer, first + i, kind, num_experts) for i in range(el)]

        def cut(t: torch.Tensor, split=split) -> torch.Tensor:
            return split_tp(t, split, tp_size=etp, tp_rank=etp_rank, padded_vocab_size=0)

        model[local] = torch.stack([cut(x["model"]) for x in pieces])
        if with_optimizer:
            if any(x["optimizer"] is None for x in pieces):
                raise CheckpointError(
                    f"{reader.iter_dir}: the expert files hold no optimizer state (saved with "
                    "--no-save-optim, or by an older ZeRO save); pass --no-load-optim"
                )
            optim[local] = {
                k: torch.stack([cut(x["optimizer"][k]) for x in pieces])
                for k in ("master", "exp_avg", "exp_avg_sq")
            }
    return model, optim


def write_expert_files(
    state: dict[str, torch.Tensor], iter_dir: str, layer_ranges: list[tuple[int, int]], swiglu: bool
) -> None:
    """A converted model's experts (logical stacked tensors ``decoder.layers.{L}.mlp.experts.
    weight1/2`` # [E, ...] in ``state``) as the expert files of EP 1 x ETP 1, one per stage."""
    per_stage: dict[int, dict] = {}
    for name, full in state.items():
        m = _LOCAL.match(name)
        if m is None:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        stage = per_stage.setdefault(stage_of(name, layer_ranges), {})
        for e in range(full.shape[0]):
            stage[f"decoder.layers.{layer}.mlp.experts.{e}.{_KINDS[kind]}.weight"] = full[e].clone()
    if not per_stage:  # a dense model: no expert files
        return
    os.makedirs(os.path.join(iter_dir, EXPERTS_DIR), exist_ok=True)
    for pp, model in per_stage.items():
        layout = {"ep_size": 1, "etp_size": 1, "swiglu": swiglu}
        record = {"layout": layout, "model": model, "optimizer": None}
        save_file(record, _file(iter_dir, pp, 0, 0))
