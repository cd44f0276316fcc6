"""The layout-independent form of a checkpoint, and the way back to any (TP, PP, DP) layout.

Logical form: full tensors keyed by GLOBAL name (``decoder.layers.{i}`` with the model's layer
number ``i``, whatever stage holds it), the vocabulary unpadded (``vocab_size`` rows), the fused QKV
and SwiGLU fc1 in their full documented order (DESIGN §5). Optimizer state (fp32 master, exp_avg,
exp_avg_sq) has the same form as its parameter. Any layout is a pure function of it:

- TP: a parameter is split along ``dim`` into ``tp_size`` equal chunks, each of ``stride`` stacked
  blocks separately (SwiGLU's ``[gate; up]``); vocabulary rows are zero-padded to the run's padded
  size first. Replicated parameters (norms, positions, row-parallel biases) are copied. The grid
  tensor-parallel modes (2d, 2.5d, 3d) hold blocks of their own (``mode_shards``); a checkpoint
  of any mode is merged into the logical form and split for any other (``merge_shards``,
  ``split_shard``, by the ``TPLayout`` of the checkpoint and of the run).
- PP: stage ``p`` holds the layers ``stage_layer_ranges(...)[p]``, numbered from 0 locally; the
  first stage the embedding, the last the final norm and output layer. With tied embeddings and
  PP > 1 the last stage's ``output_layer.weight`` is the word embedding (the logical form keeps only
  ``embedding.word_embeddings.weight``).
- DP: the model and the plain optimizer are replicated; ZeRO-1 ranges are cut by the optimizer.
- Several model chunks per rank (virtual stages, the V schedules): the layout records the
  layers of every GLOBAL stage (stage order) and which (pp rank, chunk) holds it; a shard file then
  holds ``model0``, ``model1``, ... (Megatron's keys), each numbered from 0 locally, and the plain
  optimizer's names carry the container's ``chunks.{c}.`` prefix. A global name is found by its
  stage whatever the split, so any chunk layout reshards into any other.

``CheckpointReader`` serves a saved iteration of any layout in this form, reading each shard file
once, memory-mapped, and only the stages a caller asks about.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch

from megalite.checkpoint.files import (
    MODEL_FILE,
    CheckpointError,
    distrib_optim_file,
    load_file,
    shard_dir,
)
from megalite.checkpoint.tp_shards import (
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    TPLayout,
    merge_shards,
    split_shard,
)
from megalite.core.optimizer import full_state_from_shards

OPTIMIZER_KEYS = ("master", "exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def global_name(local: str, layer_offset: int) -> str:
    m = _LAYER.match(local)
    return local if m is None else f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}"


def local_name(name: str, layer_offset: int) -> str:
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{int(m.group(1)) - layer_offset}.{m.group(2)}"


def logical_name(name: str, *, tied: bool) -> str:
    """The name under which the logical form keeps ``name`` (the tied output layer is the word
    embedding)."""
    return WORD_EMBEDDING if tied and name == OUTPUT_LAYER else name


def stage_of(name: str, layer_ranges: list[tuple[int, int]]) -> int:
    """The pipeline stage that holds the global ``name`` (a logical name: the tied output layer is
    looked up as the word embedding, on stage 0)."""
    m = _LAYER.match(name)
    if m is not None:
        layer = int(m.group(1))
        for p, (start, end) in enumerate(layer_ranges):
            if start <= layer < end:
                return p
        raise CheckpointError(f"layer {layer} of {name} is outside the checkpoint's layers")
    return 0 if name.startswith("embedding.") else len(layer_ranges) - 1


def chunk_prefix(num_chunks: int, chunk: int) -> str:
    """The prefix of chunk ``chunk``'s parameter names in the optimizer: several chunks of a rank
    share one optimizer over a ``ModelChunks`` container (``chunks.{c}.``); none for one chunk."""
    return "" if num_chunks == 1 else f"chunks.{chunk}."


class CheckpointReader:
    """One saved iteration (``SAVE/iter_0000500``) of any layout, as logical tensors.

    ``meta``: the first shard's header (config, layout, iteration, counters, scheduler). Model and
    optimizer tensors are read lazily from the stage that holds them; the ZeRO-1 files of one
    (tp, pp) shard are turned into the per-parameter form of the plain optimizer
    (``full_state_from_shards``).
    """

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        if not os.path.isdir(iter_dir):
            raise CheckpointError(f"checkpoint directory {iter_dir} does not exist")
        first = self._find_first_shard()
        self.meta = load_file(first)
        if not isinstance(self.meta, dict) or "layout" not in self.meta:
            raise CheckpointError(f"{first} is not a megalite checkpoint shard (no 'layout')")
        lay = self.meta["layout"]
        self.tp_size, self.pp_size = int(lay["tp_size"]), int(lay["pp_size"])
        self.tp_mode, self.tp_depth = lay.get("tp_mode", "1d"), int(lay.get("tp_depth", 1))
        self.dp_size = int(lay["dp_size"])
        self.layer_ranges = [tuple(r) for r in lay["layer_ranges"]]
        self.num_chunks = int(lay.get("num_chunks", 1))  # absent in one-chunk layouts
        if lay.get("stage_ranks") is not None:
            self.stage_ranks = [tuple(x) for x in lay["stage_ranks"]]
        self.distributed_optimizer = bool(lay.get("distributed_optimizer", False))
        self.model_config = self.meta["config"]["model"]
        self.vocab_size = int(self.model_config["vocab_size"])
        self.swiglu = bool(self.model_config["swiglu"])
        self.tied = not self.model_config["untie_embeddings_and_output_weights"]
        self._shards: dict[tuple[int, int], dict] = {(0, 0): self.meta}
        self._optim: dict[tuple[int, int], dict] = {}
        missing = [
            p
            for t in range(self.tp_size)
            for p in range(self.pp_size)
            if not os.path.isfile(self.path(t, p))
        ]
        if missing:
            raise CheckpointError(
                f"checkpoint {iter_dir} is incomplete: {len(missing)} shard file(s) missing, e.g. "
                f"{missing[0]}; it was not saved completely: load another iteration"
            )

    def _find_first_shard(self) -> str:
        for pp_size in (1, 2):  # mp_rank_00 (PP = 1) or mp_rank_00_000 (PP > 1)
            path = shard_dir(self.iter_dir, tp_rank=0, pp_rank=0, pp_size=pp_size)
            if os.path.isdir(path):
                return os.path.join(path, MODEL_FILE)
        raise CheckpointError(
            f"checkpoint {self.iter_dir} holds no mp_rank_00 or mp_rank_00_000 folder; it is not a "
            "complete megalite checkpoint"
        )

    def path(self, tp_rank: int, pp_rank: int, name: str = MODEL_FILE) -> str:
        folder = shard_dir(self.iter_dir, tp_rank=tp_rank, pp_rank=pp_rank, pp_size=self.pp_size)
        return os.path.join(folder, name)

    def shard(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._shards:
            self._shards[key] = load_file(self.path(tp_rank, pp_rank))
        return self._shards[key]

    def distributed_optimizer_files(self, tp_rank: int, pp_rank: int) -> list[dict]:
        """Every DP rank's ``distrib_optim_{dp}.pt`` of one (tp, pp) shard, DP order."""
        return [
            load_file(self.path(tp_rank, pp_rank, distrib_optim_file(d)))
            for d in range(self.dp_size)
        ]

    # --- several model chunks per rank ------------------------------------------------------

    num_chunks = 1  # model chunks per rank
    stage_ranks: list[tuple[int, int]] | None = None  # (pp rank, chunk) of every global stage

    def rank_of_stage(self, stage: int) -> tuple[int, int]:
        """(pp rank, chunk) of global stage ``stage``."""
        return (stage, 0) if self.stage_ranks is None else tuple(self.stage_ranks[stage])

    def chunk_ranges(self, pp_rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` layers of each chunk of ``pp_rank``, chunk 0 first."""
        found = {}
        for s, r in enumerate(self.layer_ranges):
            p, c = self.rank_of_stage(s)
            if p == pp_rank:
                found[c] = tuple(r)
        return [found[c] for c in sorted(found)]

    def chunk_model(self, tp_rank: int, pp_rank: int, chunk: int = 0) -> dict:
        """The state dict (local names) of one chunk of a saved (tp, pp) shard."""
        shard = self.shard(tp_rank, pp_rank)
        return shard["model"] if self.num_chunks == 1 else shard[f"model{chunk}"]

    def optimizer_key(self, chunk: int, local: str) -> str:
        """The plain optimizer's name of ``local`` in ``chunk`` (a container's prefix when the
        rank held several chunks)."""
        return chunk_prefix(self.num_chunks, chunk) + local

    def global_names(self) -> list[str]:
        """Every model tensor's global name, stage order (the tied output copy left out)."""
        out = []
        for s, (start, _) in enumerate(self.layer_ranges):
            p, c = self.rank_of_stage(s)
            for local in self.chunk_model(0, p, c):
                name = global_name(local, start)
                if logical_name(name, tied=self.tied) == name:
                    out.append(name)
        return out

    # --- the logical form ---------------------------------------------------------------------

    def _locate(self, name: str) -> tuple[int, str]:
        name = logical_name(name, tied=self.tied)
        p = stage_of(name, self.layer_ranges)
        return p, local_name(name, self.layer_ranges[p][0])

    def model_tensor(self, name: str) -> torch.Tensor:
        """The full logical tensor of the global ``name``."""
        s, local = self._locate(name)
        p, c = self.rank_of_stage(s)
        shards = []
        for t in range(self.tp_size):
            model = self.chunk_model(t, p, c)
            if local not in model:
                raise CheckpointError(
                    f"{self.path(t, p)} holds no {local!r}; the checkpoint is of another model "
                    "(compare its flags with this run's)"
                )
            shards.append(model[local])
        return self._merge(shards, name)

    @property
    def tp(self) -> TPLayout:
        """The tensor-parallel layout the checkpoint was saved under."""
        return TPLayout(self.tp_mode, self.tp_size, self.tp_depth)

    def _merge(self, shards: list[torch.Tensor], name: str) -> torch.Tensor:
        """The saved TP shards (rank order) of ``name`` -> its full logical tensor."""
        return merge_shards(shards, name, self.tp, swiglu=self.swiglu, vocab_size=self.vocab_size)

    def has_optimizer(self) -> bool:
        return self.meta.get("optimizer") is not None

    def optimizer_state(self, tp_rank: int, pp_rank: int) -> dict:
        """The optimizer state of one saved (tp, pp) shard in the per-parameter form:
        ``{"params": {local_name: {"master", "exp_avg", "exp_avg_sq"}}, "step", "scaler"}``."""
        key = (tp_rank, pp_rank)
        if key not in self._optim:
            state = self.shard(tp_rank, pp_rank).get("optimizer")
            if state is None:
                raise CheckpointError(
                    f"{self.path(tp_rank, pp_rank)} holds no optimizer state (saved with "
                    "--no-save-optim, or converted); pass --no-load-optim or --finetune"
                )
            if state.get("distributed"):
                state = full_state_from_shards(self.distributed_optimizer_files(tp_rank, pp_rank))
            self._optim[key] = state
        return self._optim[key]

    def optimizer_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """``{"master", "exp_avg", "exp_avg_sq"}`` of the global ``name``, full and logical."""
        s, local = self._locate(name)
        p, c = self.rank_of_stage(s)
        key = self.optimizer_key(c, local)
        per_rank = [self.optimizer_state(t, p)["params"][key] for t in range(self.tp_size)]
        return {key: self._merge([r[key] for r in per_rank], name) for key in OPTIMIZER_KEYS}

    def optimizer_header(self) -> dict:
        """``{"step": int, "scaler": dict | None}`` of the saved optimizer."""
        state = self.optimizer_state(0, 0)
        return {"step": int(state.get("step", 0)), "scaler": state.get("scaler")}


def reshard_model(
    reader: CheckpointReader,
    local_names: Iterable[str],
    *,
    layer_offset: int,
    tp: TPLayout,
    tp_rank: int,
    padded_vocab_size: int,
) -> dict[str, torch.Tensor]:
    """The stage-local state dict of a stage whose parameters are ``local_names``, for TP rank
    ``tp_rank`` of the tensor layout ``tp``."""
    out = {}
    for local in local_names:
        name = global_name(local, layer_offset)
        out[local] = split_shard(
            reader.model_tensor(name),
            name,
            tp,
            tp_rank=tp_rank,
            swiglu=reader.swiglu,
            padded_vocab_size=padded_vocab_size,
        )
    return out


def reshard_optimizer(
    reader: CheckpointReader,
    local_names: Iterable[str],
    *,
    layer_offset: int,
    tp: TPLayout,
    tp_rank: int,
    padded_vocab_size: int,
) -> dict:
    """The optimizer state of one stage in the "full over DP" form that ``load_full_state_dict``
    takes: ``{"params": {local: {"master", "exp_avg", "exp_avg_sq"}}, "step", "scaler"}``."""
    params = {}
    for local in local_names:
        name = global_name(local, layer_offset)
        params[local] = {
            key: split_shard(
                full,
                name,
                tp,
                tp_rank=tp_rank,
                swiglu=reader.swiglu,
                padded_vocab_size=padded_vocab_size,
            )
            for key, full in reader.optimizer_tensors(name).items()
        }
    return {"params": params, **reader.optimizer_header()}
