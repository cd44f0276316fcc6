"""Checkpoints written by Megatron-LM, loaded at any layout (DESIGN §5), and the format choice.

    fmt = detect_format(iter_dir)          # "torch" (legacy), "torch_dist", or None (megalite's)
    loaded = load_megatron_checkpoint(iter_dir, fmt, model_chunks=..., optimizer=..., ...)

Both of Megatron's formats are served as megalite's logical form (``resharding``: full tensors by
global name) by a ``CheckpointReader`` subclass: ``LegacyReader`` converts each
``model_optim_rng.pt`` into megalite's per-stage shard form, ``DistReader`` (``megatron_dist``)
reads the global tensors of a ``torch_dist`` directory. The load then goes through the same
resharding as a megalite checkpoint of another layout: model, Adam state (fp32 masters, moments,
step), scheduler position, iteration and consumed samples. Megatron's RNG states
(``rng_state``: Python ``random``, numpy, torch CPU, CUDA and the tracker's per (TP, PP[, DP])
rank) are restored when the layout matches (same TP and PP: ``rng_state_from_megatron``);
otherwise the run is re-seeded from ``--seed`` + iteration with one warning, as after a reshard.

Megatron's model settings come from the checkpoint's ``args`` (``model_config_from_args``) and are
checked against this run's as a megalite checkpoint's are; the model settings megalite
implements beyond the shapes (``MATH_FLAGS``: ``--add-qkv-bias``, ``--qk-layernorm``,
``--apply-layernorm-1p``, ``--squared-relu``, ``--rotary-percent``, ...) must equal this run's
flags, and a checkpoint of a model megalite does not build (``UNREAD_MODEL_ARGS``) is refused,
each in one line. The distributed optimizer's ``distrib_optim.pt`` (``--use-distributed-
optimizer`` with ``--ckpt-format torch``) is read by ``megatron_distopt``. The scheduler position
is Megatron's ``num_steps`` in samples (``--rampup-batch-size`` included), converted to megalite's
final-size global batches. Refused with one line: expert or virtual pipeline parallel checkpoints.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import nn

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron_legacy import (
    adam_state_by_name,
    find_megatron_shard,
    load_megatron_file,
)
from megalite.checkpoint.records import check_model_compatible
from megalite.checkpoint.resharding import CheckpointReader, reshard_model, reshard_optimizer
from megalite.core.pipeline_parallel.stages import stage_layer_ranges

logger = logging.getLogger(__name__)

CKPT_FORMATS = ("megalite", "torch", "torch_dist")


def detect_format(iter_dir: str) -> str | None:
    """``"torch_dist"`` (a ``metadata.json`` naming a sharded backend), ``"torch"`` (a Megatron
    ``model_optim_rng.pt``), or None (megalite's own files, or nothing there)."""
    meta = os.path.join(iter_dir, "metadata.json")
    if os.path.isfile(meta):
        import json

        with open(meta, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(
                f"{meta}: Megatron's sharded backend {backend!r} is not read (only torch_dist); "
                "convert it with Megatron's checkpoint converter to torch_dist or torch"
            )
        return "torch_dist"
    return "torch" if find_megatron_shard(iter_dir) else None


def _arg(args, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def model_config_from_args(args) -> dict:
    """The GPTConfig fields a Megatron run's ``args`` fix (for ``check_model_compatible``)."""
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    hidden = int(args.hidden_size)
    if _arg(args, "num_experts"):
        raise CheckpointError(
            "a Megatron MoE checkpoint (--num-experts) is not read here yet (issue 16)"
        )
    return {
        "num_layers": int(args.num_layers),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": int(_arg(args, "kv_channels", hidden // heads)),
        "ffn_hidden_size": int(_arg(args, "ffn_hidden_size", 4 * hidden)),
        "max_position_embeddings": int(_arg(args, "max_position_embeddings", args.seq_length)),
        "position_embedding_type": _arg(args, "position_embedding_type", "learned_absolute"),
        "normalization": _arg(args, "normalization", "LayerNorm"),
        "swiglu": bool(_arg(args, "swiglu", False)),
        "add_bias_linear": bool(_arg(args, "add_bias_linear", True)),
        "untie_embeddings_and_output_weights": bool(
            _arg(args, "untie_embeddings_and_output_weights", False)
        ),
        "rotary_base": int(_arg(args, "rotary_base", 10000)),
        "norm_epsilon": float(_arg(args, "norm_epsilon", 1e-5)),
        "openai_gelu": bool(_arg(args, "openai_gelu", False)),
    }


# Megatron's model flags that megalite implements beyond the shapes ``model_config_from_args``
# gives: (args name, GPTConfig field, flag, Megatron's default); a difference from this run's
# flags is refused (``check_math_flags``): the tensors would load into another function.
MATH_FLAGS = (
    ("add_qkv_bias", "add_qkv_bias", "--add-qkv-bias", False),
    ("qk_layernorm", "qk_layernorm", "--qk-layernorm", False),
    ("apply_layernorm_1p", "apply_layernorm_1p", "--apply-layernorm-1p", False),
    ("squared_relu", "squared_relu", "--squared-relu", False),
    ("rotary_percent", "rotary_percent", "--rotary-percent", 1.0),
    ("rotary_interleaved", "rotary_interleaved", "--rotary-interleaved", False),
    ("use_rope_scaling", "use_rope_scaling", "--use-rope-scaling", False),
    ("rope_scaling_factor", "rope_scaling_factor", "--rope-scaling-factor", 8.0),
)
# Megatron model settings megalite has no equivalent for: a checkpoint that uses one is refused
UNREAD_MODEL_ARGS = (
    ("multi_latent_attention", "--multi-latent-attention"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("linear_attention_freq", "--linear-attention-freq"),
    ("is_hybrid_model", "a hybrid (Mamba) model"),
)


def math_flags_from_args(args) -> dict:
    """The values of ``MATH_FLAGS`` a Megatron run's ``args`` hold (Megatron's defaults where an
    older Megatron did not record one), normalised as megalite builds the model."""
    out = {field: _arg(args, name, default) for name, field, _, default in MATH_FLAGS}
    out["add_qkv_bias"] = bool(out["add_qkv_bias"]) or bool(_arg(args, "add_bias_linear", True))
    if _arg(args, "position_embedding_type", "learned_absolute") != "rope":
        for key in ("rotary_percent", "rotary_interleaved", "use_rope_scaling"):
            out.pop(key)
    if not out.get("use_rope_scaling"):
        out.pop("rope_scaling_factor")
    return out


def check_math_flags(args, current, *, where: str) -> None:
    """Refuse, in one line, a Megatron checkpoint whose ``args`` name a model setting this run's
    flags contradict (``MATH_FLAGS``) or one megalite does not implement (``UNREAD_MODEL_ARGS``)."""
    for name, flag in UNREAD_MODEL_ARGS:
        if _arg(args, name, None) not in (None, False, 0):
            raise CheckpointError(
                f"Megatron checkpoint {where} was trained with {flag} "
                f"{_arg(args, name)!r}, which megalite does not implement; it cannot be loaded"
            )
    saved = math_flags_from_args(args)
    now = {field: getattr(current, field) for _, field, _, _ in MATH_FLAGS}
    now["add_qkv_bias"] = bool(now["add_qkv_bias"]) or bool(current.add_bias_linear)
    for _, field, flag, _ in MATH_FLAGS:
        if field in saved and saved[field] != now[field]:
            raise CheckpointError(
                f"Megatron checkpoint {where} was trained with {flag} {saved[field]!r} but this "
                f"run has {now[field]!r}; give the checkpoint's {flag} setting"
            )


def layer_ranges_from_args(args) -> list[tuple[int, int]]:
    pp = int(_arg(args, "pipeline_model_parallel_size", 1))
    if _arg(args, "num_layers_per_virtual_pipeline_stage") or _arg(
        args, "num_virtual_stages_per_pipeline_rank"
    ):
        raise CheckpointError(
            "a Megatron checkpoint with virtual pipeline stages (model0, model1, ... per file) is "
            "not read yet (issue 18); save it from Megatron without them, or convert it"
        )
    uneven = pp > 1
    return [
        tuple(r)
        for r in stage_layer_ranges(
            int(args.num_layers),
            pp,
            first_stage_layers=_arg(args, "decoder_first_pipeline_num_layers") if uneven else None,
            last_stage_layers=_arg(args, "decoder_last_pipeline_num_layers") if uneven else None,
        )
    ]


class MegatronReader(CheckpointReader):
    """The common part of both Megatron formats: sizes and settings from the saved ``args``."""

    format = ""

    def _init_from_args(self, iter_dir: str, args, *, iteration: int, scheduler: dict | None):
        self.iter_dir = iter_dir
        self.args = args
        if int(_arg(args, "expert_model_parallel_size", 1)) > 1:
            raise CheckpointError(
                f"{iter_dir}: a Megatron checkpoint with --expert-model-parallel-size > 1 is not "
                "read here yet (issue 16)"
            )
        self.tp_size = int(_arg(args, "tensor_model_parallel_size", 1))
        self.pp_size = int(_arg(args, "pipeline_model_parallel_size", 1))
        self.dp_size = int(_arg(args, "data_parallel_size", 1))
        self.layer_ranges = layer_ranges_from_args(args)
        self.model_config = model_config_from_args(args)
        self.padded_vocab_size = int(_arg(args, "padded_vocab_size", 0))
        self.vocab_size = int(_arg(args, "vocab_size", self.padded_vocab_size) or 0)
        self.swiglu = self.model_config["swiglu"]
        self.tied = not self.model_config["untie_embeddings_and_output_weights"]
        self.distributed_optimizer = bool(_arg(args, "use_distributed_optimizer", False))
        self._full_distributed = None
        self._shards, self._optim = {}, {}
        self.meta = {
            "iteration": iteration,
            "consumed_train_samples": int(_arg(args, "consumed_train_samples", 0)),
            "consumed_valid_samples": int(_arg(args, "consumed_valid_samples", 0)),
            "megatron_scheduler": scheduler,
            "layout": {"padded_vocab_size": self.padded_vocab_size},
        }

    def rng_states(self, tp_rank: int, pp_rank: int) -> list[dict] | None:
        """The ``rng_state`` list of a (TP, PP) rank (one entry per DP rank, or one), or None."""
        raise NotImplementedError

    def use_vocab(self, vocab_size: int) -> None:
        """Serve the first ``vocab_size`` rows of the (Megatron-padded) vocabulary tensors."""
        if self.padded_vocab_size and vocab_size > self.padded_vocab_size:
            raise CheckpointError(
                f"{self.iter_dir}: this run's vocabulary of {vocab_size} ids exceeds the "
                f"checkpoint's {self.padded_vocab_size} rows; check --vocab-size / the tokenizer"
            )
        self.vocab_size = vocab_size


class LegacyReader(MegatronReader):
    """Megatron's ``torch`` format, one ``model_optim_rng.pt`` per (TP, PP) rank."""

    format = "torch"

    def __init__(self, iter_dir: str):
        first = find_megatron_shard(iter_dir)
        self._raw: dict[tuple[int, int], dict] = {}
        head = load_megatron_file(first)
        if "args" not in head:
            raise CheckpointError(f"{first} holds no 'args': not a Megatron-LM training checkpoint")
        if any(k.startswith("model") and k != "model" for k in head):
            raise CheckpointError(
                f"{first}: a Megatron checkpoint with virtual pipeline stages is not read yet "
                "(issue 18)"
            )
        self._init_from_args(
            iter_dir,
            head["args"],
            iteration=int(head.get("iteration", 0)),
            scheduler=head.get("opt_param_scheduler"),
        )
        self._raw[(0, 0)] = head
        self.meta["checkpoint_version"] = head.get("checkpoint_version")
        if float(head.get("checkpoint_version", 0)) < 3.0:
            raise CheckpointError(
                f"{first}: Megatron checkpoint_version {head.get('checkpoint_version')} predates "
                "3.0 (another QKV order); load and save it once with a recent Megatron-LM"
            )
        missing = [
            self.path(t, p)
            for t in range(self.tp_size)
            for p in range(self.pp_size)
            if not os.path.isfile(self.path(t, p))
        ]
        if missing:
            raise CheckpointError(
                f"Megatron checkpoint {iter_dir} is incomplete: {len(missing)} shard file(s) "
                f"missing, e.g. {missing[0]}"
            )

    def _raw_shard(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._raw:
            self._raw[key] = load_megatron_file(self.path(tp_rank, pp_rank))
        return self._raw[key]

    def shard(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._shards:
            raw = self._raw_shard(tp_rank, pp_rank)
            model = {
                k: v
                for k, v in raw["model"].items()
                if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")
            }
            self._shards[key] = {"model": model, "optimizer": raw.get("optimizer")}
        return self._shards[key]

    def rng_states(self, tp_rank: int, pp_rank: int) -> list[dict] | None:
        return self._raw_shard(tp_rank, pp_rank).get("rng_state")

    def has_optimizer(self) -> bool:
        if self.distributed_optimizer:  # Adam's state in distrib_optim.pt, the rest in "optimizer"
            return os.path.isfile(self.path(0, 0, "distrib_optim.pt"))
        return self._raw_shard(0, 0).get("optimizer") is not None

    def optimizer_state(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._optim:
            if self.distributed_optimizer:
                self._optim[key] = self._distributed_state(tp_rank, pp_rank)
                return self._optim[key]
            raw = self._raw_shard(tp_rank, pp_rank)
            if raw.get("optimizer") is None:
                raise CheckpointError(
                    f"{self.path(tp_rank, pp_rank)} holds no optimizer state (saved with "
                    "--no-save-optim); pass --no-load-optim or --finetune"
                )
            self._optim[key] = adam_state_by_name(
                raw["optimizer"], raw["model"], where=self.path(tp_rank, pp_rank)
            )
        return self._optim[key]

    def _distributed_state(self, tp_rank: int, pp_rank: int) -> dict:
        from megalite.checkpoint.megatron_distopt import read_distrib_optim

        path = self.path(tp_rank, pp_rank, "distrib_optim.pt")
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing (Megatron saved with --use-distributed-optimizer and not "
                "--no-save-optim writes it beside model_optim_rng.pt); pass --no-load-optim"
            )
        raw = self._raw_shard(tp_rank, pp_rank)
        return read_distrib_optim(path, raw, tp_rank=tp_rank, pp_rank=pp_rank)


def open_reader(iter_dir: str, fmt: str) -> MegatronReader:
    if fmt == "torch":
        return LegacyReader(iter_dir)
    from megalite.checkpoint.megatron_dist import DistReader

    return DistReader(iter_dir)


def load_megatron_checkpoint(
    iter_dir: str,
    fmt: str,
    *,
    module: nn.Module,
    optimizer,
    scheduler,
    ps,
    seed: int,
    load_optim: bool,
    finetune: bool,
    load_model_state,
    load_rng: bool = True,
):
    """Load a Megatron checkpoint into this rank's stage ``module`` (any layout; module doc).

    ``load_model_state(module, state, where)`` sets the module (``loading._load_model``). Returns
    ``(progress_fields | None, reseed | None, reader)`` for ``loading.load_checkpoint``."""
    reader = open_reader(iter_dir, fmt)
    check_model_compatible(reader.model_config, module.config, where=iter_dir)
    check_math_flags(reader.args, module.config, where=iter_dir)
    reader.use_vocab(module.config.vocab_size)
    state = reshard_model(
        reader,
        module.state_dict().keys(),
        layer_offset=module.layer_range[0],
        tp_size=ps.tp_size,
        tp_rank=ps.tp_rank,
        padded_vocab_size=module.padded_vocab_size,
    )
    load_model_state(module, state, iter_dir)
    if finetune:
        return None, None, None, reader
    if load_optim:
        full = reshard_optimizer(
            reader,
            [n for n, _ in module.named_parameters()],
            layer_offset=module.layer_range[0],
            tp_size=ps.tp_size,
            tp_rank=ps.tp_rank,
            padded_vocab_size=module.padded_vocab_size,
        )
        try:
            optimizer.load_full_state_dict(full)
        except ValueError as e:
            raise CheckpointError(f"{str(e).splitlines()[0]}; or pass --no-load-optim") from None
    iteration = int(reader.meta["iteration"])
    saved = reader.meta.get("megatron_scheduler") or {}
    steps = scheduler_steps_from_samples(
        saved.get("num_steps", reader.meta["consumed_train_samples"]),
        scheduler.samples_per_step,
    )
    scheduler.load_state_dict({**scheduler.state_dict(), "num_steps": steps})
    current = scheduler.state_dict()
    if saved and float(saved.get("max_lr", current["max_lr"])) != float(current["max_lr"]):
        logger.warning(
            "the Megatron checkpoint's --lr %s differs from this run's %s; this run's is used",
            saved.get("max_lr"), current["max_lr"],
        )  # fmt: skip
    if not load_rng:
        return reader.meta, None, None, reader
    rng_state, why = _rng_for_rank(reader, ps)
    if rng_state is not None:
        return reader.meta, rng_state, None, reader
    reseed = seed + iteration
    logger.warning(
        "Megatron checkpoint %s (%s format, TP %d x PP %d): RNG states not restored (%s); "
        "Python, numpy, torch and tensor-parallel generators re-seeded with --seed + "
        "iteration = %d",
        iter_dir, fmt, reader.tp_size, reader.pp_size, why, reseed,
    )  # fmt: skip
    return reader.meta, None, reseed, reader


def _rng_for_rank(reader: MegatronReader, ps) -> tuple[dict | None, str]:
    """This rank's saved RNG states in megalite's form, or (None, why not)."""
    if (reader.tp_size, reader.pp_size) != (ps.tp_size, ps.pp_size):
        return None, f"saved at another layout than this run's TP {ps.tp_size} x PP {ps.pp_size}"
    entries = reader.rng_states(ps.tp_rank, ps.pp_rank)
    if not entries:
        return None, "saved with --no-save-rng"
    dp_size, dp_rank = ps.size("dp", "cp"), ps.rank("dp", "cp")
    if len(entries) == dp_size:
        return rng_state_from_megatron(entries[dp_rank]), ""
    if _arg(reader.args, "data_parallel_random_init", False):
        return (
            None,
            f"--data-parallel-random-init states of DP {len(entries)}, this run's {dp_size}",
        )
    # without --data-parallel-random-init every DP rank of Megatron holds the same states: [0]
    return rng_state_from_megatron(entries[0]), ""


def _is_cpu_state(state) -> bool:
    return isinstance(state, torch.Tensor) and state.numel() == torch.get_rng_state().numel()


def rng_state_from_megatron(entry: dict) -> dict:
    """One rank's Megatron ``rng_state`` entry -> megalite's form (``records.capture_rng_state``).

    The device generator and the tracker's ``"tensor-parallel"`` state (Megatron's
    ``"model-parallel-rng"``: per TP rank, shared over DP, as megalite's) are CUDA states when
    Megatron ran on GPUs; on a CPU run (megalite's, or Megatron's under the fixtures' workaround)
    they are CPU generator states and the default generator is torch's CPU one."""
    from megalite.core.tensor_parallel.random import TP_RNG

    py = entry["random_rng_state"]
    n = entry["np_rng_state"]
    cuda = entry.get("cuda_rng_state")
    tracker = (entry.get("rng_tracker_states") or {}).get("model-parallel-rng")
    return {
        "torch_cpu": entry["torch_rng_state"],
        "cuda": None if cuda is None or _is_cpu_state(cuda) else cuda,
        "tracker": None if tracker is None else {TP_RNG: tracker},
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": {
            "kind": n[0],
            "keys": torch.from_numpy(np.asarray(n[1]).astype(np.int64)),
            "pos": int(n[2]),
            "has_gauss": int(n[3]),
            "cached_gaussian": float(n[4]),
        },
    }


def scheduler_steps_from_samples(samples, samples_per_step: int) -> int | float:
    """Megatron's scheduler position (``num_steps``: samples consumed, ``--rampup-batch-size``
    included) -> megalite's (global batches of the final size; fractional during a ramp)."""
    steps = int(samples) / int(samples_per_step)
    return int(steps) if steps.is_integer() else steps


def scheduler_samples_from_steps(num_steps: int | float, samples_per_step: int) -> int:
    """megalite's scheduler position -> Megatron's, in samples (``scheduler_steps_from_samples``'s
    inverse)."""
    return int(round(float(num_steps) * int(samples_per_step)))


__all__ = [
    "CKPT_FORMATS",
    "LegacyReader",
    "MATH_FLAGS",
    "MegatronReader",
    "check_math_flags",
    "detect_format",
    "load_megatron_checkpoint",
    "model_config_from_args",
    "open_reader",
    "rng_state_from_megatron",
    "scheduler_samples_from_steps",
    "scheduler_steps_from_samples",
]

_ = torch  # torch is used by the readers' tensors
