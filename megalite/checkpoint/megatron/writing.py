"""megalite's logical form -> Megatron-LM's ``torch`` and ``torch_dist`` files.

What Megatron's ``load_checkpoint`` then finds (without ``--finetune``): ``args`` (a Namespace of
the run's settings under Megatron's names, counters included), ``checkpoint_version`` 3.0, the
model (with the ``_extra_state`` entries of Megatron's linear layers), the Adam state in the form
of Megatron's plain optimizer (``FP32Optimizer``; ``Float16Optimizer``'s with
``fp32_from_fp16_params`` for a bf16/fp16 model), the scheduler in samples, and RNG states under
Megatron's names (``states``). A ``--use-distributed-optimizer`` run is written in the form of
Megatron's distributed optimizer: ``distrib_optim.pt`` (``distopt.flat_layout``, from the bucket
flags recorded in ``args``) in the ``torch`` format, the ``fully_reshardable`` form
(``optimizer.state.param.*`` beside the moments, the step in the param groups of ``common.pt``) in
``torch_dist``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import warnings

import torch

from megalite.checkpoint.files import MODEL_FILE, fsync_dir, save_file, shard_dir
from megalite.checkpoint.megatron.dcp import torch_dcp
from megalite.checkpoint.megatron.dist import (
    DISTOPT_MASTER_PREFIX,
    MASTER_PREFIX,
    OPTIM_PREFIX,
    sharded_key,
    write_metadata_json,
)
from megalite.checkpoint.megatron.distopt import (
    DISTRIB_OPTIM_FILE,
    FLAT_KEYS,
    bucket_size_from_args,
    flat_layout,
    shared_embedding_name,
)
from megalite.checkpoint.megatron.legacy import (
    CHECKPOINT_VERSION,
    adam_state_dict,
    no_weight_decay,
    param_group,
)
from megalite.checkpoint.megatron.states import rng_state_to_megatron, scheduler_to_megatron
from megalite.checkpoint.resharding import OUTPUT_LAYER, CheckpointReader, global_name
from megalite.checkpoint.tp_shards import split_tp, tp_split

_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# a layer's modules in Megatron's order (its parameters' and its optimizer's order)
_LAYER_ORDER = (
    "input_layernorm",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "self_attention.q_layernorm",
    "self_attention.k_layernorm",
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# the Transformer Engine layers whose (empty) _extra_state torch_dist holds per layer
DIST_EXTRA_STATES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# the settings torch's Adam records in each param group beside lr, betas and eps
TORCH_ADAM_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def megatron_order(name: str) -> tuple:
    """Sort key: Megatron's module order (its parameters' and its optimizer's order)."""
    m = _LAYER.match(name)
    kind = 0 if name.endswith("weight") else 1
    if m is not None:
        sub = _LAYER_ORDER.index(m.group(2)) if m.group(2) in _LAYER_ORDER else 9
        return (1, int(m.group(1)), sub, int(m.group(3) == "bias"))
    if name.startswith("embedding."):
        return (0, 0, 0 if "word" in name else 1, kind)
    if name.startswith("decoder.final_layernorm"):
        return (2, 0, 0, kind)
    return (3, 0, 0, kind)


def megatron_args(
    meta: dict,
    reader: CheckpointReader,
    *,
    use_dist_ckpt: bool,
    distributed_optimizer: bool = False,
) -> argparse.Namespace:
    """The ``args`` Megatron's loader reads: every section of the recorded config flattened under
    its (Megatron) field names, the layout and the counters."""
    values: dict = {}
    config = meta.get("config", {})
    for section in config.values():
        if isinstance(section, dict):
            values.update(section)
    model = config["model"]
    dtype = str(values.pop("params_dtype", "torch.float32"))
    values.update(
        bf16=dtype == "torch.bfloat16",  # Megatron's precision flags, from the model's dtype
        fp16=dtype == "torch.float16",
        tensor_model_parallel_size=reader.tp_size,
        pipeline_model_parallel_size=reader.pp_size,
        data_parallel_size=reader.dp_size,
        world_size=reader.tp_size * reader.pp_size * reader.dp_size,
        padded_vocab_size=int(meta["layout"]["padded_vocab_size"]),
        group_query_attention=model["num_query_groups"] != model["num_attention_heads"],
        consumed_train_samples=int(meta["consumed_train_samples"]),
        consumed_valid_samples=int(meta.get("consumed_valid_samples", 0)),
        skipped_train_samples=0,
        iteration=meta["iteration"],
        ckpt_format="torch_dist" if use_dist_ckpt else "torch",
        use_dist_ckpt=use_dist_ckpt,
        use_distributed_optimizer=distributed_optimizer,
        no_save_optim=meta.get("optimizer") is None,
        no_save_rng=meta.get("rng_state") is None,
        data_parallel_random_init=False,
        written_by="megalite",
    )
    values.pop("tokenizer", None)
    return argparse.Namespace(**values)


def _optimizer_groups(meta: dict) -> dict:
    """The learning rate, weight decay and Adam settings of Megatron's param groups, from the
    recorded config and scheduler."""
    opt = meta.get("config", {}).get("optimizer", {})
    sched = meta.get("scheduler") or {}
    return {
        "lr": float(sched.get("max_lr", opt.get("lr", 0.0))),
        "weight_decay": float(opt.get("weight_decay", 0.0)),
        "extra": {
            "max_lr": float(opt.get("lr", 0.0)),
            "min_lr": float(opt.get("min_lr", 0.0)),
            "betas": (float(opt.get("adam_beta1", 0.9)), float(opt.get("adam_beta2", 0.999))),
            "eps": float(opt.get("adam_eps", 1e-8)),
            **TORCH_ADAM_DEFAULTS,
        },
    }


def _param_groups(meta: dict) -> list[dict]:
    """Megatron's two default param groups (with weight decay, without) with this run's
    settings, as its distributed optimizer saves them (no parameter indices)."""
    g = _optimizer_groups(meta)
    return [
        {**param_group(lr=g["lr"], weight_decay=g["weight_decay"], wd_mult=wd_mult), **g["extra"]}
        for wd_mult in (1.0, 0.0)
    ]


def _legacy_optimizer(full: dict, names: list[str], model: dict, meta: dict) -> dict:
    g = _optimizer_groups(meta)
    sd = adam_state_dict(full, names, lr=g["lr"], weight_decay=g["weight_decay"])
    for group in sd["param_groups"]:
        group.update(g["extra"])
    if all(model[n].dtype == torch.float32 for n in names):
        return sd  # Megatron's FP32Optimizer: torch's Adam state dict
    decayed = [n for n in names if not no_weight_decay(n, model[n].shape)]
    plain = [n for n in names if no_weight_decay(n, model[n].shape)]
    masters = [[full["params"][n]["master"] for n in group] for group in (decayed, plain) if group]
    out = {"optimizer": sd, "fp32_from_fp16_params": masters}
    if full.get("scaler") is not None:  # fp16's loss scaler; Megatron's bf16 run has none
        out["grad_scaler"] = full["scaler"]
    return out


def _config_value(meta: dict, key: str, default=None):
    """``key`` of the first section of the recorded config that has it, else ``default``."""
    for section in meta.get("config", {}).values():
        if isinstance(section, dict) and key in section:
            return section[key]
    return default


def writes_distrib_optim(meta: dict, reader: CheckpointReader) -> bool:
    """``--ckpt-format torch`` of a ``--use-distributed-optimizer`` run: Megatron's form of that
    run, ``distrib_optim.pt`` beside each ``model_optim_rng.pt`` (what Megatron's loader reads when
    the resuming run has ``--use-distributed-optimizer``)."""
    distributed = bool(_config_value(meta, "use_distributed_optimizer", False))
    return distributed and reader.has_optimizer()


def _distributed_optimizer(
    full: dict, names: list[str], model: dict, meta: dict, args, pp_rank: int
) -> tuple[dict, dict]:
    """One (TP, PP) rank's Adam state in Megatron's distributed-optimizer form: the ``optimizer``
    entry of ``model_optim_rng.pt`` (param groups with the step, no per-parameter state) and the
    ``distrib_optim.pt`` dict (the flat, bucketed ranges of ``distopt.flat_layout``)."""
    groups = [{**group, "step": int(full["step"])} for group in _param_groups(meta)]
    optimizer = {"optimizer": {"param_groups": groups}}
    if full.get("scaler") is not None:
        optimizer["grad_scaler"] = full["scaler"]
    params = [(n, model[n].numel()) for n in names]
    bucket = bucket_size_from_args(args, pp_rank=pp_rank, stage_numel=sum(k for _, k in params))
    shared = shared_embedding_name(args, pp_rank, int(args.pipeline_model_parallel_size))
    spans, total = flat_layout(params, bucket_size=bucket, shared=shared)
    flat = {src: torch.zeros(total, dtype=torch.float32) for src in FLAT_KEYS.values()}
    for name in names:
        start, end = spans[name]
        for key, src in FLAT_KEYS.items():
            flat[src][start:end] = full["params"][name][key].reshape(-1)
    param_dtype = model[names[0]].dtype if names else torch.float32
    # Megatron keys its buffers by (param dtype, grad dtype): the grads' dtype of the run
    fp32_grads = bool(_config_value(meta, "accumulate_allreduce_grads_in_fp32", True))
    grad_dtype = torch.float32 if fp32_grads else param_dtype
    buffer = {(param_dtype, grad_dtype): {**flat, "numel_unpadded": total}}
    return optimizer, {"buckets_coalesced": True, 0: buffer}


def _with_extra_states(model: dict, post_process: bool) -> dict:
    out = {}
    for name in sorted(model, key=megatron_order):
        out[name] = model[name]
        module, kind = name.rsplit(".", 1)
        if kind == "weight" and module.rsplit(".", 1)[-1] in _LINEAR:
            out[f"{module}._extra_state"] = None
    if post_process:
        out["output_layer._extra_state"] = None
    return out


def write_legacy(reader: CheckpointReader, dst: str) -> None:
    """Megatron's ``torch`` format in ``dst``: one ``model_optim_rng.pt`` per (TP, PP) rank."""
    meta = reader.meta
    distopt = writes_distrib_optim(meta, reader)
    args = megatron_args(meta, reader, use_dist_ckpt=False, distributed_optimizer=distopt)
    scheduler = scheduler_to_megatron(meta)
    for t in range(reader.tp_size):
        for p in range(reader.pp_size):
            shard = reader.shard(t, p)
            model = shard["model"]
            names = sorted(model, key=megatron_order)
            state = {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": meta["iteration"],
                "model": _with_extra_states(model, post_process=p == reader.pp_size - 1),
                "num_floating_point_operations_so_far": 0,
            }
            distrib_optim = None
            if reader.has_optimizer():
                full = reader.optimizer_state(t, p)
                if distopt:
                    state["optimizer"], distrib_optim = _distributed_optimizer(
                        full, names, model, meta, args, p
                    )
                else:
                    state["optimizer"] = _legacy_optimizer(full, names, model, meta)
                state["opt_param_scheduler"] = scheduler
            if shard.get("rng_state"):
                state["rng_state"] = [rng_state_to_megatron(r) for r in shard["rng_state"]]
            folder = shard_dir(dst, tp_rank=t, pp_rank=p, pp_size=reader.pp_size)
            os.makedirs(folder, exist_ok=True)
            if distrib_optim is not None:
                save_file(distrib_optim, os.path.join(folder, DISTRIB_OPTIM_FILE))
            save_file(state, os.path.join(folder, MODEL_FILE))
            fsync_dir(folder)


def _object(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)
    buf.seek(0)
    return buf


def _raw_bytes_planner():
    """A save planner that writes a ``BytesIO`` value as its bytes (megatron-core's sharded
    objects are ``torch.save([obj])``), where torch's default planner would pickle the BytesIO
    itself."""
    dcp = torch_dcp()

    class RawBytesPlanner(dcp.DefaultSavePlanner):
        def transform_object(self, write_item, object):  # noqa: A002 (torch's signature)
            if write_item.type == dcp.planner.WriteItemType.BYTE_IO and isinstance(
                object, io.BytesIO
            ):
                return object
            return super().transform_object(write_item, object)

    return RawBytesPlanner()


def write_dist(reader: CheckpointReader, dst: str) -> None:
    """Megatron's ``torch_dist`` format in ``dst``: the global tensors under their sharded keys
    (``dist``), ``common.pt`` and ``metadata.json``."""
    meta = reader.meta
    padded = int(meta["layout"]["padded_vocab_size"])
    names = []
    for p in range(reader.pp_size):
        offset = reader.layer_ranges[p][0]
        for local in reader.shard(0, p)["model"]:
            name = global_name(local, offset)
            if not (reader.tied and name == OUTPUT_LAYER):
                names.append(name)
    has_optim = reader.has_optimizer()
    # --use-distributed-optimizer: Megatron's "fully_reshardable" form of its distributed
    # optimizer (the fp32 masters as optimizer.state.param.<key> beside the moments, the param
    # groups with the step in common.pt), which its loader reads at any DP size
    distopt = has_optim and bool(_config_value(meta, "use_distributed_optimizer", False))
    out: dict = {}
    layers: dict[str, list] = {}

    def put(prefix: str, name: str, tensor: torch.Tensor) -> None:
        split = tp_split(name, swiglu=reader.swiglu)
        if split.vocab:
            tensor = split_tp(tensor, split, tp_size=1, tp_rank=0, padded_vocab_size=padded)
        key, layer = sharded_key(name)
        if layer is None:
            out[prefix + key] = tensor.contiguous()
        else:
            layers.setdefault(prefix + key, {})[layer] = tensor

    for name in names:
        weight = reader.model_tensor(name)
        put("", name, weight)
        if has_optim:
            o = reader.optimizer_tensors(name)
            put(OPTIM_PREFIX["exp_avg"], name, o["exp_avg"])
            put(OPTIM_PREFIX["exp_avg_sq"], name, o["exp_avg_sq"])
            if weight.dtype != torch.float32:
                put(MASTER_PREFIX, name, o["master"])
            if distopt:
                put(DISTOPT_MASTER_PREFIX, name, o["master"].float())
    num_layers = int(meta["config"]["model"]["num_layers"])
    for key, by_layer in layers.items():
        out[key] = torch.stack([by_layer[i] for i in range(num_layers)]).contiguous()
    for module in DIST_EXTRA_STATES:
        for i in range(num_layers):
            out[f"decoder.layers.{module}._extra_state/shard_{i}_{num_layers}"] = _object(None)
    for t in range(reader.tp_size):
        for p in range(reader.pp_size):
            rng = reader.shard(t, p).get("rng_state")
            if rng:
                key = f"rng_state/shard_{p}.{t}_{reader.pp_size}.{reader.tp_size}"
                out[key] = _object([rng_state_to_megatron(r) for r in rng])
    os.makedirs(dst, exist_ok=True)
    with warnings.catch_warnings():  # "assuming ... a single process": so it is
        warnings.simplefilter("ignore", UserWarning)
        writer = torch_dcp().FileSystemWriter(dst)
        torch_dcp().save(out, storage_writer=writer, planner=_raw_bytes_planner(), no_dist=True)
    common = {
        "args": megatron_args(meta, reader, use_dist_ckpt=True, distributed_optimizer=distopt),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": meta["iteration"],
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }
    if has_optim:
        groups = _param_groups(meta)
        header = reader.optimizer_header()
        step = header["step"]
        torch_state = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
        # Megatron's FP32Optimizer saves torch's state dict as it is; its fp16/bf16 optimizer nests
        # it under "optimizer" (its fp32_from_fp16_params are the fp32_param tensors above)
        common["optimizer"] = torch_state
        if _config_value(meta, "params_dtype", "torch.float32") != "torch.float32":
            common["optimizer"] = {"optimizer": torch_state}
            if header["scaler"] is not None:
                common["optimizer"]["grad_scaler"] = header["scaler"]
        if distopt:
            for group in groups:
                group["step"] = int(step)
            common["optimizer"] = {
                "optimizer": {"param_groups": groups},
                "param_state_sharding_type": "fully_reshardable",
            }
            common["content_metadata"].update(
                distrib_optim_sharding_type="fully_reshardable",
                distrib_optim_fully_reshardable_mem_efficient=False,
            )
        common["opt_param_scheduler"] = scheduler_to_megatron(meta)
    save_file(common, os.path.join(dst, "common.pt"))
    write_metadata_json(dst)
    fsync_dir(dst)
