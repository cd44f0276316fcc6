"""Megatron-LM's ``torch_dist`` checkpoint format (its default), read and written.

    SAVE/iter_0000500/metadata.json   {"sharded_backend": "torch_dist", ...}
    SAVE/iter_0000500/common.pt       args, iteration, scheduler, optimizer param groups and step
    SAVE/iter_0000500/.metadata       torch.distributed.checkpoint's index of the global tensors
    SAVE/iter_0000500/__{rank}_{n}.distcp

The tensors are GLOBAL, keyed by Megatron's sharded keys: a transformer layer's parameter is one
tensor stacked over every layer of the model (``decoder.layers.mlp.linear_fc1.weight`` of shape
``[num_layers, 2 * ffn, h]``), the norms under the names of Transformer Engine's fused layers
(``input_layernorm`` is ``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm`` is
``mlp.linear_fc1.layer_norm_weight``), the SwiGLU ``fc1`` as ``[gate; up]``, the vocabulary
Megatron-padded. Adam's moments are ``optimizer.state.exp_avg.<key>`` / ``exp_avg_sq``, the fp32
masters of a half-precision run ``optimizer.state.fp32_param.<key>``. That is megalite's logical
form up to these names, so ``DistReader`` maps names and slices the layer axis, and
``save_dist_checkpoint`` writes the same from a megalite run.

Reading needs no process group: one key at a time is read in full (``no_dist``).
"""

from __future__ import annotations

import io
import json
import os
import re
import warnings

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron.dcp import torch_dcp
from megalite.checkpoint.megatron.legacy import load_megatron_file, safe_pickle
from megalite.checkpoint.megatron.readers import MegatronReader
from megalite.checkpoint.resharding import OPTIMIZER_KEYS, logical_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megalite's (= Megatron's local spec) layer-relative names -> the names of the sharded keys
NORM_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
OPTIM_PREFIX = {"exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq."}
MASTER_PREFIX = "optimizer.state.fp32_param."
DISTOPT_MASTER_PREFIX = "optimizer.state.param."  # the distributed optimizer's fully_reshardable


def sharded_key(name: str) -> tuple[str, int | None]:
    """megalite's global name -> (Megatron's sharded key, the layer index into its first dim)."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    rest = m.group(2)
    return f"decoder.layers.{NORM_KEYS.get(rest, rest)}", int(m.group(1))


class DistReader(MegatronReader):
    """One ``torch_dist`` iteration directory as megalite's logical form."""

    format = "torch_dist"

    def __init__(self, iter_dir: str):
        common = load_megatron_file(os.path.join(iter_dir, "common.pt"))
        if "args" not in common:
            raise CheckpointError(f"{iter_dir}/common.pt holds no 'args': not a Megatron run's")
        self._init_from_args(
            iter_dir,
            common["args"],
            iteration=int(common.get("iteration", 0)),
            scheduler=common.get("opt_param_scheduler"),
        )
        self.common = common
        self._storage = torch_dcp().FileSystemReader(iter_dir)
        try:
            self._index = self._storage.read_metadata().state_dict_metadata
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"{iter_dir}/.metadata cannot be read ({str(e)[:120]}); the torch_dist checkpoint "
                "is incomplete: load another iteration"
            ) from None
        self._cache: dict[str, torch.Tensor] = {}
        if any(k.startswith("optimizer.distributed.") for k in self._index):
            self._optim_refusal = (
                f"{iter_dir}: Megatron's distributed optimizer state saved 'dp_reshardable' (flat "
                "grad-buffer ranges) is not read; pass --no-load-optim, or save it "
                "from Megatron with --dist-ckpt-optim-fully-reshardable"
            )
        else:
            self._optim_refusal = None

    def _global(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            meta = self._index.get(key)
            if not isinstance(meta, torch_dcp().metadata.TensorStorageMetadata):
                raise CheckpointError(
                    f"Megatron checkpoint {self.iter_dir} holds no tensor {key!r}; the checkpoint "
                    "is of another model (compare its flags with this run's)"
                )
            out = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
            with warnings.catch_warnings():  # "assuming ... a single process": so it is
                warnings.simplefilter("ignore", UserWarning)
                torch_dcp().load(out, storage_reader=self._storage, no_dist=True)
            self._cache[key] = out[key]
        return self._cache[key]

    def _tensor(self, prefix: str, name: str) -> torch.Tensor:
        key, layer = sharded_key(logical_name(name, tied=self.tied))
        full = self._global(prefix + key)
        full = full if layer is None else full[layer]
        if name.endswith("word_embeddings.weight") or (name == "output_layer.weight"):
            full = full.narrow(0, 0, self.vocab_size)
        return full

    def model_tensor(self, name: str) -> torch.Tensor:
        return self._tensor("", name)

    def has_optimizer(self) -> bool:
        return self._optim_refusal is not None or any(
            k.startswith(OPTIM_PREFIX["exp_avg"]) for k in self._index
        )

    def optimizer_tensors(self, name: str) -> dict[str, torch.Tensor]:
        if self._optim_refusal:
            raise CheckpointError(self._optim_refusal)
        key, _ = sharded_key(logical_name(name, tied=self.tied))
        master = next(
            (p for p in (MASTER_PREFIX, DISTOPT_MASTER_PREFIX) if p + key in self._index), ""
        )
        out = {
            "master": self._tensor(master, name).float(),
            "exp_avg": self._tensor(OPTIM_PREFIX["exp_avg"], name).float(),
            "exp_avg_sq": self._tensor(OPTIM_PREFIX["exp_avg_sq"], name).float(),
        }
        assert set(out) == set(OPTIMIZER_KEYS)
        return out

    def rng_states(self, tp_rank: int, pp_rank: int) -> list[dict] | None:
        """Megatron's ``rng_state`` sharded object of (PP, TP) (``shard_{pp}.{tp}_{PP}.{TP}``; one
        per DP rank, ``shard_{pp}.{tp}.{dp}_...``, under --data-parallel-random-init)."""
        plain = f"rng_state/shard_{pp_rank}.{tp_rank}_{self.pp_size}.{self.tp_size}"
        if plain in self._index:
            return _read_objects(self._storage, [plain])[0]
        sizes = f"{self.pp_size}.{self.tp_size}.{self.dp_size}"
        per_dp = [f"rng_state/shard_{pp_rank}.{tp_rank}.{d}_{sizes}" for d in range(self.dp_size)]
        if not all(k in self._index for k in per_dp):
            return None
        return [entry for obj in _read_objects(self._storage, per_dp) for entry in obj]

    def optimizer_header(self) -> dict:
        """Adam's step from ``common.pt``: ``state.common_step`` of torch's state dict, which
        Megatron's FP32 optimizer saves as it is and its fp16/bf16 optimizer nests under
        ``optimizer``; the distributed optimizer's ``fully_reshardable`` form keeps the step in
        its param groups instead."""
        optim = self.common.get("optimizer") or {}
        inner = optim.get("optimizer") or {}
        step = next(
            (
                level["state"]["common_step"]
                for level in (optim, inner)
                if "common_step" in (level.get("state") or {})
            ),
            None,
        )
        if step is None:
            groups = inner.get("param_groups") or [{}]
            step = max(int(g.get("step") or 0) for g in groups)
        return {"step": int(step), "scaler": None}


def _read_objects(storage, keys: list[str]) -> list:
    """The sharded objects ``keys`` (bytes items, each ``torch.save`` of a one-element list, as
    megatron-core writes them), unpickled safely."""
    raw: dict[str, bytes] = {}
    dcp = torch_dcp()

    class _Bytes(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw[read_item.dest_index.fqn] = value.read()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        buffers = {k: io.BytesIO() for k in keys}
        dcp.load(buffers, storage_reader=storage, planner=_Bytes(), no_dist=True)
    out = []
    for key in keys:
        obj = torch.load(io.BytesIO(raw[key]), weights_only=False, pickle_module=safe_pickle)
        out.append(obj[0] if isinstance(obj, list) and len(obj) == 1 else obj)
    return out


# the metadata.json Megatron writes beside a torch_dist checkpoint (``detect_format`` reads it)
METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def write_metadata_json(iter_dir: str) -> None:
    with open(os.path.join(iter_dir, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump(METADATA, f)
