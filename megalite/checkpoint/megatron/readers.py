"""Megatron-LM's checkpoints as megalite's logical form (``resharding``: full tensors by name).

``MegatronReader`` is the common part of both of Megatron's formats: the sizes, stages and model
settings its ``args`` fix (``args``). ``LegacyReader`` serves the ``torch`` format, one
``model_optim_rng.pt`` per (TP, PP) rank, converted into megalite's per-stage shard form
(``legacy``), with the distributed optimizer's ``distrib_optim.pt`` beside it (``distopt``);
``dist.DistReader`` serves ``torch_dist``. A load then reshards them as a megalite checkpoint of
another layout.
"""

from __future__ import annotations

import os

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron.args import arg, layer_ranges_from_args, model_config_from_args
from megalite.checkpoint.megatron.distopt import DISTRIB_OPTIM_FILE, read_distrib_optim
from megalite.checkpoint.megatron.legacy import (
    adam_state_by_name,
    find_megatron_shard,
    load_megatron_file,
)
from megalite.checkpoint.resharding import CheckpointReader


class MegatronReader(CheckpointReader):
    """The common part of both Megatron formats: sizes and settings from the saved ``args``."""

    format = ""
    tp_mode, tp_depth = "1d", 1  # Megatron's tensor parallelism is 1d

    def _init_from_args(self, iter_dir: str, args, *, iteration: int, scheduler: dict | None):
        self.iter_dir = iter_dir
        self.args = args
        if int(arg(args, "expert_model_parallel_size", 1)) > 1:
            raise CheckpointError(
                f"{iter_dir}: a Megatron checkpoint with --expert-model-parallel-size > 1 is not "
                "read: megalite reads Megatron's dense checkpoints"
            )
        self.tp_size = int(arg(args, "tensor_model_parallel_size", 1))
        self.pp_size = int(arg(args, "pipeline_model_parallel_size", 1))
        self.dp_size = int(arg(args, "data_parallel_size", 1))
        self.layer_ranges = layer_ranges_from_args(args)
        self.model_config = model_config_from_args(args)
        self.padded_vocab_size = int(arg(args, "padded_vocab_size", 0))
        self.vocab_size = int(arg(args, "vocab_size", self.padded_vocab_size) or 0)
        self.swiglu = self.model_config["swiglu"]
        self.tied = not self.model_config["untie_embeddings_and_output_weights"]
        self.distributed_optimizer = bool(arg(args, "use_distributed_optimizer", False))
        self._shards, self._optim = {}, {}
        self.meta = {
            "iteration": iteration,
            "consumed_train_samples": int(arg(args, "consumed_train_samples", 0)),
            "consumed_valid_samples": int(arg(args, "consumed_valid_samples", 0)),
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
                f"{first}: a Megatron checkpoint with virtual pipeline stages is not read; save it "
                "from Megatron without them"
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
            return os.path.isfile(self.path(0, 0, DISTRIB_OPTIM_FILE))
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
        path = self.path(tp_rank, pp_rank, DISTRIB_OPTIM_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing (Megatron saved with --use-distributed-optimizer and not "
                "--no-save-optim writes it beside model_optim_rng.pt); pass --no-load-optim"
            )
        raw = self._raw_shard(tp_rank, pp_rank)
        return read_distrib_optim(path, raw, tp_rank=tp_rank, pp_rank=pp_rank)
