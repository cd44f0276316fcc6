"""The per-concern configuration dataclasses of a pretraining run, each validating itself.

``PretrainConfig`` is made of ``model`` (``GPTConfig``), ``parallel`` (``ParallelConfig``,
``parallel_config.py``), ``optimizer`` (``OptimizerConfig``, with the loss scaling of fp16),
``data`` (``DataConfig``), ``training`` and ``logging``. Fields are named
after Megatron-LM's flags (``--lr-warmup-iters`` is ``lr_warmup_iters``). Each setting has one
home, the lowest layer that needs it: the model's dataclass holds ``seq_length``, ``seed``,
``params_dtype`` (``--bf16`` / ``--fp16``), ``sequence_parallel`` and ``cp_comm_type``, and the
parts of a run that need them read them there. A config built in code is checked exactly as one
parsed from flags:

    cfg = with_tokenizer(cfg)             # builds the tokenizer, fills the vocab size, validates
    cfg.validate()                        # ConfigError (one line naming fields and numbers)
    n = cfg.check_world(ps.world_size, ps.dp_size)   # after the mesh, before any data is read

The defaults written here are the flags' defaults (``megalite.training.arguments`` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megalite.checkpoint.megatron.saving import megatron_format_refusal
from megalite.core.mesh_layout import MeshSizes, check_shared_pipelines
from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.core.tensor_parallel.modes import check_cube_dims, check_grid_dims
from megalite.data.config import DataConfig
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.errors import ConfigError, at_least
from megalite.models.config import VOCAB_FROM_TOKENIZER, GPTConfig
from megalite.models.moe_config import check_moe_parallel
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.parallel_config import ParallelConfig
from megalite.training.pipeline_config import check_pipeline_config
from megalite.training.signals import parse_signal


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 1
    eval_interval: int = 1000
    eval_iters: int = 100
    check_for_nan_in_loss_and_grad: bool = True
    exit_interval: int | None = None
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    # checkpointing (megalite.checkpoint, through megalite.training.checkpoint_io)
    ckpt_step: int | None = None  # load this iteration instead of the tracker's
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # weights only; iteration and data position start at 0
    exit_duration_in_mins: float | None = None
    keep_last_n_checkpoints: int | None = None
    exit_signal_handler: bool = False  # --exit-signal-handler: save and exit 0 on the signal
    exit_signal: str = "SIGTERM"  # --exit-signal
    ckpt_format: str = "megalite"  # megalite (own) | torch | torch_dist (Megatron's)
    # write checkpoints from a host copy in a background thread (megalite.checkpoint.async_save)
    async_save: bool = False
    # Megatron's non-persistent checkpoints: every N iterations into a second folder (fast or
    # node-local storage, SAVE/non_persistent by default), only the newest kept; a resume loads
    # the newer of it and --load
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: str = "global"  # Megatron's "local" / "in_memory" are refused
    non_persistent_global_ckpt_dir: str | None = None
    # the LR schedule's settings (rates, warmup, decay length and style) from the checkpoint
    # loaded instead of from the flags, as Megatron's --use-checkpoint-opt_param-scheduler
    use_checkpoint_opt_param_scheduler: bool = False
    # torch's deterministic algorithms and the environment of bit-exact GPU runs (determinism)
    deterministic_mode: bool = False
    # loss = token sum / unmasked tokens of the global batch (train_step)
    calculate_per_token_loss: bool = False
    # batch-size schedules (megalite.training.microbatches) and the sample budget
    rampup_batch_size: list[int] | None = None  # --rampup-batch-size START INCREMENT SAMPLES
    step_batch_size_schedule: str | None = None  # --step-batch-size-schedule "0:B0 T1:B1 ..."
    train_samples: int | None = None  # --train-samples (train_iters is derived from it)

    def num_microbatches(self, dp_size: int) -> int:
        """Micro-batches per DP rank per iteration: gbs / (mbs x ``dp_size``), the mesh's DP size;
        ConfigError when it does not divide."""
        per_step = self.micro_batch_size * dp_size
        if per_step < 1 or self.global_batch_size < 1 or self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x data-parallel size {dp_size} = {per_step}; use a "
                f"multiple of {per_step}, or change micro_batch_size or the data-parallel size"
            )
        return self.global_batch_size // per_step

    def validate(self) -> None:
        at_least(1, ("micro_batch_size", self.micro_batch_size))
        at_least(1, ("global_batch_size", self.global_batch_size))
        at_least(1, ("train_iters", self.train_iters))
        at_least(0, ("eval_interval", self.eval_interval), ("eval_iters", self.eval_iters))
        self.num_microbatches(1)  # the global batch is whole micro-batches
        at_least(1, ("save_interval", self.save_interval))
        at_least(1, ("keep_last_n_checkpoints", self.keep_last_n_checkpoints))
        at_least(1, ("exit_interval", self.exit_interval))
        at_least(0, ("ckpt_step", self.ckpt_step))
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError(
                f"exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}"
            )
        at_least(1, ("non_persistent_save_interval", self.non_persistent_save_interval))
        if self.non_persistent_ckpt_type != "global":
            raise ConfigError(
                f"non_persistent_ckpt_type {self.non_persistent_ckpt_type} is not implemented "
                "(per-rank local and in-memory copies); use global with "
                "non_persistent_global_ckpt_dir DIR on fast or node-local storage"
            )
        for name, value in (
            ("save_interval", self.save_interval),
            ("keep_last_n_checkpoints", self.keep_last_n_checkpoints),
            ("non_persistent_save_interval", self.non_persistent_save_interval),
        ):
            if value is not None and self.save is None:
                raise ConfigError(f"{name} {value} needs save DIR (where checkpoints go)")
        for name, value in (
            ("ckpt_step", self.ckpt_step),
            ("finetune", self.finetune or None),
            ("no_load_optim", self.no_load_optim or None),
            ("no_load_rng", self.no_load_rng or None),
        ):
            if value is not None and self.load is None:
                raise ConfigError(f"{name} needs load DIR (the checkpoint directory to read)")
        try:
            parse_signal(self.exit_signal)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    peak_tflops: float | None = None
    log_num_zeros_in_grad: bool = False
    # slow ranks (training/stragglers.py): each rank's compute and communication time per step,
    # gathered at the log interval; ranks whose compute exceeds straggler_slowdown x the median
    # are named, and the straggler_minmax_count slowest and fastest listed
    log_straggler: bool = False
    straggler_minmax_count: int = 1
    straggler_slowdown: float = 1.5

    def validate(self) -> None:
        at_least(1, ("log_interval", self.log_interval))
        at_least(1, ("straggler_minmax_count", self.straggler_minmax_count))
        if self.straggler_slowdown <= 1:
            raise ConfigError(f"straggler_slowdown must be > 1, got {self.straggler_slowdown}")
        at_least(1, ("tensorboard_log_interval", self.tensorboard_log_interval))
        at_least(1, ("tensorboard_queue_size", self.tensorboard_queue_size))
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"peak_tflops must be > 0, got {self.peak_tflops}")


@dataclass
class PretrainConfig:
    model: GPTConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    logging: LoggingConfig
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)  # with_tokenizer

    def validate(self) -> None:
        """Each concern's ``validate``, then the rules that join them. One-line ConfigError.
        A ``model.vocab_size`` still ``VOCAB_FROM_TOKENIZER`` passes (``with_tokenizer`` sets it;
        the model refuses to be built without it)."""
        par, m, t = self.parallel, self.model, self.training
        par.validate()
        par.resolve_grad_dtype(bf16=m.precision_name == "bf16")
        _check_tp_mode(par, m, micro_batch_size=t.micro_batch_size, ckpt_format=t.ckpt_format)
        tp, pp = par.tp_split_size, par.pipeline_model_parallel_size
        try:  # the first/last stage counts apply to a training run even on one stage
            stage_layer_ranges(
                m.num_layers,
                pp,
                first_stage_layers=m.decoder_first_pipeline_num_layers,
                last_stage_layers=m.decoder_last_pipeline_num_layers,
            )
            if m.vocab_size == VOCAB_FROM_TOKENIZER:  # not known yet: with_tokenizer fills it
                replace(m, vocab_size=1).validate(tp_size=tp, pp_size=pp)
            else:
                m.validate(tp_size=tp, pp_size=pp)
            self.data.validate()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        t.validate()
        if par.world_size is not None:
            t.num_microbatches(par.data_parallel_size)  # DP = world / (tp x pp x cp)
        _check_cp(par, m)
        check_pipeline_config(self)
        self.optimizer.validate(train_iters=t.train_iters)
        if self.optimizer.optimizer != "adam" and par.sharding_strategy() != "no_shard":
            raise ConfigError(
                f"optimizer {self.optimizer.optimizer} keeps its state whole on every DP rank: "
                f"data_parallel_sharding_strategy {par.sharding_strategy()} (ZeRO-1/2/3) is not "
                "supported with it; drop use_distributed_optimizer or use the adam optimizer"
            )
        self.logging.validate()
        self._validate_experts()
        masked = self.data.reset_attention_mask or m.block_sparse
        if masked and par.context_parallel_size > 1 and m.cp_comm_type == "all_gather":
            raise ConfigError(
                "reset_attention_mask, window_size and sparse_attention with context_parallel_size "
                f"{par.context_parallel_size} need cp_comm_type p2p or a2a, not all_gather"
            )
        if self.tokenizer is not None and self.tokenizer.vocab_size != m.vocab_size:
            raise ConfigError(
                f"model.vocab_size {m.vocab_size} differs from the tokenizer's "
                f"{self.tokenizer.vocab_size}; build the config with with_tokenizer()"
            )

    def _validate_experts(self) -> None:
        """The expert-parallel sizes against the model and the world (one line)."""
        par = self.parallel
        ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
        etp = par.tensor_model_parallel_size if etp is None else etp
        sizes = {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        try:
            check_moe_parallel(self.model, ep_size=ep, etp_size=etp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        view = etp * ep * par.pipeline_model_parallel_size
        if par.world_size is not None and par.world_size % view:
            raise ConfigError(
                f"world size {par.world_size} is not divisible by expert_tensor_parallel_size "
                f"{etp} x expert_model_parallel_size {ep} x pipeline_model_parallel_size "
                f"{par.pipeline_model_parallel_size} = {view}; change the expert sizes"
            )
        if par.world_size is not None:  # the views' pipeline groups in the run's rank order
            sizes = MeshSizes(
                par.world_size,
                tp=par.tensor_model_parallel_size,
                cp=par.context_parallel_size,
                pp=par.pipeline_model_parallel_size,
                ep=ep,
                etp=etp,
                order=par.rank_order,
            )
            try:
                check_shared_pipelines(sizes)
            except ValueError as e:
                raise ConfigError(f"use_tp_pp_dp_mapping: {e}") from None

    def check_world(self, world_size: int, dp_size: int) -> int:
        """Refuse a config parsed for another world; return the micro-batches per DP rank per
        iteration for the mesh's ``dp_size``. Call after the mesh, before reading data."""
        parsed = self.parallel.world_size
        if parsed is not None and parsed != world_size:
            raise ConfigError(
                f"this config was parsed for a world of {parsed} ranks but is running on "
                f"{world_size}: launch {parsed} processes, or parse the flags again under the "
                f"new launcher"
            )
        mp = self.parallel.model_parallel_size * self.parallel.context_parallel_size
        if mp * dp_size != world_size:
            raise ConfigError(
                f"the mesh's data-parallel size {dp_size} x tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size {mp} is not the world "
                f"size {world_size}"
            )
        return self.training.num_microbatches(dp_size)


def _check_cp(par: ParallelConfig, m: GPTConfig) -> None:
    """The sequence and heads a context-parallel split needs (one-line ConfigError)."""
    cp, tp = par.context_parallel_size, par.tensor_model_parallel_size
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"seq_length {m.seq_length} is not divisible by 2 x context_parallel_size {cp} = "
            f"{2 * cp} (each cp rank holds 2 of the 2 x CP chunks); use a multiple of {2 * cp}"
        )
    if m.sequence_parallel and (m.seq_length // cp) % tp:
        raise ConfigError(
            f"seq_length {m.seq_length} / context_parallel_size {cp} is not divisible by "
            f"tensor_model_parallel_size {tp} under sequence_parallel; use a multiple of "
            f"{cp * tp}"
        )
    if m.cp_comm_type == "a2a" and m.num_attention_heads % (tp * cp):
        raise ConfigError(
            f"num_attention_heads {m.num_attention_heads} is not divisible by "
            f"tensor_model_parallel_size {tp} x context_parallel_size {cp} = {tp * cp} "
            f"(cp_comm_type a2a splits the heads); use cp_comm_type p2p or a multiple of "
            f"{tp * cp} heads"
        )


def _check_tp_mode(
    par: ParallelConfig, m: GPTConfig, *, micro_batch_size: int, ckpt_format: str
) -> None:
    """A 2d / 2.5d / 3d tensor group: the features it refuses, the dims its grid splits."""
    mode = par.tensor_parallel_mode
    if mode == "1d":
        return
    if ckpt_format != "megalite":
        raise ConfigError(megatron_format_refusal(mode, ckpt_format))
    refused = [
        (par.context_parallel_size > 1, f"context_parallel_size {par.context_parallel_size}"),
        (m.sequence_parallel, "sequence_parallel (the grid splits activations itself)"),
        (m.num_experts is not None, f"num_experts {m.num_experts} (MoE)"),
        (m.qk_layernorm, "qk_layernorm"),
        (m.apply_layernorm_1p, "apply_layernorm_1p"),
    ]
    for on, what in refused:
        if on:
            raise ConfigError(
                f"tensor_parallel_mode {mode} does not combine with {what}; use "
                "tensor_parallel_mode 1d or drop it"
            )
    try:
        if mode == "3d":
            check_cube_dims(
                par.tp_split_size,
                hidden_size=m.hidden_size,
                num_attention_heads=m.num_attention_heads,
                num_query_groups=m.num_query_groups,
                kv_channels=m.kv_channels,
                ffn_hidden_size=m.ffn_hidden_size,
                micro_batch_size=micro_batch_size,
            )
            return
        check_grid_dims(
            par.tp_split_size,
            par.tensor_parallel_depth,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size,
            micro_batch_size=micro_batch_size,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def with_tokenizer(cfg: PretrainConfig) -> PretrainConfig:
    """``cfg`` with its tokenizer built (``megalite.data.tokenizers``; loads the model file of a
    SentencePiece / HuggingFace tokenizer) and ``model.vocab_size`` filled from it, validated.
    A config whose tokenizer is set already is only validated."""
    if cfg.tokenizer is None:
        try:
            cfg.data.validate()
            tokenizer = build_tokenizer(cfg.data)
        except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: a corrupt model file
            raise ConfigError(str(e).splitlines()[0]) from None
        vocab = cfg.model.vocab_size
        if vocab not in (VOCAB_FROM_TOKENIZER, tokenizer.vocab_size):
            raise ConfigError(
                f"model.vocab_size {vocab} differs from the tokenizer's {tokenizer.vocab_size}; "
                f"leave it {VOCAB_FROM_TOKENIZER} to take the tokenizer's"
            )
        model = replace(cfg.model, vocab_size=tokenizer.vocab_size)
        cfg = replace(cfg, model=model, tokenizer=tokenizer)
    cfg.validate()
    return cfg
