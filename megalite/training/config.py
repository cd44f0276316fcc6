"""The per-concern configuration dataclasses of a pretraining run, each validating itself.

``PretrainConfig`` is made of ``model`` (``GPTConfig``), ``parallel``, ``optimizer`` (with mixed
precision and loss scaling), ``data`` (``DataConfig``), ``training`` and ``logging``. Fields are
named after Megatron-LM's flags (``--lr-warmup-iters`` is ``lr_warmup_iters``). A config built in
code is checked exactly as one parsed from flags:

    cfg = with_tokenizer(cfg)             # builds the tokenizer, fills the vocab size, validates
    cfg.validate()                        # ConfigError (one line naming fields and numbers)
    n = cfg.check_world(ps.world_size, ps.dp_size)   # after the mesh, before any data is read

The defaults written here are the flags' defaults (``megalite.training.arguments`` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.data.config import DataConfig
from megalite.errors import ConfigError, at_least
from megalite.models.config import VOCAB_FROM_TOKENIZER, GPTConfig
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.pipeline_config import check_pipeline_config
from megalite.training.signals import parse_signal

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")  # issue 14
CP_COMM_TYPES = ("p2p", "a2a", "all_gather")  # issue 15
DEVICES = ("auto", "cpu", "cuda")


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")  # issue 13


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"  # or "gpipe"
    # issue 14: virtual pipeline stages (Megatron's flags) and p2p overlap
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    microbatch_group_size_per_virtual_pipeline_stage: int | None = None  # None: pp
    no_overlap_p2p_communication: bool = False
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None  # elements; None: max(40M, 1M x dp)
    ddp_num_buckets: int | None = None  # issue 18: bucket size = the rank's parameters // N
    accumulate_allreduce_grads_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1: all-gather a bucket before its first use
    distributed_timeout_minutes: float = 10.0
    device: str = "auto"  # auto | cpu | cuda
    world_size: int | None = None  # the launcher's, when parsed from flags; None: built in code
    use_tp_pp_dp_mapping: bool = False  # rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp
    # issue 15: context parallel (the sequence split over cp ranks; shards no parameter)
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # p2p | a2a | all_gather
    # issue 13: the ZeRO ladder and optimizer offload (validate_zero)
    data_parallel_sharding_strategy: str | None = None  # no_shard|optim|optim_grads|..._params
    zero_stage: int | None = None  # DeepSpeed's alias: 0 1 2 3
    optimizer_cpu_offload: bool = False  # optimizer state and step on the host
    optimizer_offload_fraction: float = 1.0  # share of the optimizer state offloaded
    optimizer_offload_dir: str | None = None  # NVMe: the offloaded state in files there
    optimizer_offload_host_memory_mb: float = 256.0  # host buffer bound of the NVMe stream
    # issue 16: the expert view of the mesh (etp x ep x edp x pp); ETP None = the TP size
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None

    @property
    def rank_order(self) -> str:
        """The mesh's axis order, fastest first (Megatron's default, or its alternative)."""
        return "tp-cp-ep-pp-dp" if self.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int | None:
        """DP size of the world this config was parsed for (None without one); a run uses its
        mesh's ``ps.dp_size``."""
        if self.world_size is None:
            return None
        return self.world_size // (self.model_parallel_size * self.context_parallel_size)

    def sharding_strategy(self) -> str:  # issue 13
        """The data-parallel rung: ``no_shard`` (DDP), ``optim`` (ZeRO-1), ``optim_grads``
        (ZeRO-2) or ``optim_grads_params`` (ZeRO-3)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        if self.zero_stage is not None:
            return SHARDING_STRATEGIES[self.zero_stage]
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def offload(self) -> bool:  # issue 13
        return self.optimizer_cpu_offload or self.optimizer_offload_dir is not None

    def validate_zero(self) -> None:  # issue 13
        """The rung and offload flags agree (one line each otherwise); sets
        ``use_distributed_optimizer`` for every sharded rung."""
        s, z = self.data_parallel_sharding_strategy, self.zero_stage
        if s is not None and s not in SHARDING_STRATEGIES:
            raise ConfigError(
                f"data_parallel_sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, "
                f"got {s!r}"
            )
        if z is not None and z not in range(4):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {z}")
        if s is not None and z is not None and SHARDING_STRATEGIES[z] != s:
            raise ConfigError(
                f"zero_stage {z} is data_parallel_sharding_strategy {SHARDING_STRATEGIES[z]}, not "
                f"{s}; pass one of the two"
            )
        chosen = s if s is not None else None if z is None else SHARDING_STRATEGIES[z]
        if self.use_distributed_optimizer and chosen == "no_shard":
            raise ConfigError(
                "use_distributed_optimizer shards the optimizer state, data_parallel_sharding_"
                "strategy no_shard (zero_stage 0) does not; drop one of them"
            )
        strategy = self.sharding_strategy()
        if strategy == "optim_grads_params" and self.overlap_param_gather:
            raise ConfigError(
                "overlap_param_gather does not apply to ZeRO-3 (optim_grads_params), which "
                "gathers each unit before its forward and prefetches the next; drop "
                "overlap_param_gather"
            )
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ConfigError(
                f"optimizer_offload_fraction must be in [0, 1], got "
                f"{self.optimizer_offload_fraction}"
            )
        if self.offload and strategy == "no_shard":
            raise ConfigError(
                "optimizer_cpu_offload / optimizer_offload_dir offload the sharded optimizer "
                "state: add use_distributed_optimizer or a zero_stage >= 1"
            )
        if self.optimizer_offload_host_memory_mb <= 0:
            raise ConfigError(
                f"optimizer_offload_host_memory_mb must be > 0, got "
                f"{self.optimizer_offload_host_memory_mb}"
            )
        if strategy != "no_shard":
            self.use_distributed_optimizer = True

    def bucket_size(self, dp_size: int | None = None, stage_numel: int | None = None) -> int:
        """Elements per grad bucket: ``ddp_bucket_size``, else max(40M, 1M x ``dp_size``)."""
        if self.ddp_num_buckets is not None and stage_numel is not None:  # issue 18
            return max(stage_numel // self.ddp_num_buckets, 1)
        if self.ddp_bucket_size is not None:
            return self.ddp_bucket_size
        dp = dp_size if dp_size is not None else self.data_parallel_size or 1
        return max(40_000_000, 1_000_000 * dp)

    def validate(self) -> None:
        self.validate_zero()  # issue 13
        for name, value in (
            ("tensor_model_parallel_size", self.tensor_model_parallel_size),
            ("pipeline_model_parallel_size", self.pipeline_model_parallel_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got "
                f"{self.pipeline_schedule!r}"
            )
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError(
                f"distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ConfigError(f"ddp_bucket_size must be >= 1 element, got {self.ddp_bucket_size}")
        if self.ddp_num_buckets is not None and (  # issue 18, as Megatron
            self.ddp_num_buckets < 1 or self.ddp_bucket_size is not None
        ):
            raise ConfigError(
                f"ddp_num_buckets {self.ddp_num_buckets}: give a count >= 1 and not together "
                f"with ddp_bucket_size ({self.ddp_bucket_size}); drop one of the two"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(
                "overlap_param_gather needs use_distributed_optimizer (it overlaps ZeRO-1's "
                "parameter all-gather with the next forward); turn it on or drop "
                "overlap_param_gather"
            )
        if self.overlap_grad_reduce and not self.use_distributed_optimizer:
            raise ConfigError(
                "overlap_grad_reduce is implemented for use_distributed_optimizer only; turn it "
                "on, or drop overlap_grad_reduce (the all-reduce then runs after backward)"
            )
        self._validate_cp()  # issue 15
        if self.world_size is not None:
            mp = self.model_parallel_size
            tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
            if self.world_size < 1 or self.world_size % mp:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by tensor_model_parallel_size "
                    f"{tp} x pipeline_model_parallel_size {pp} = {mp}; launch a multiple of {mp} "
                    "processes or change the sizes"
                )
            cp = self.context_parallel_size  # issue 15
            if self.world_size % (mp * cp):
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by tensor x pipeline "
                    f"model-parallel size {mp} x context_parallel_size {cp} = {mp * cp}; launch a "
                    f"multiple of {mp * cp} processes or change the sizes"
                )

    def _validate_cp(self) -> None:  # issue 15
        cp = self.context_parallel_size
        if not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"context_parallel_size must be an integer >= 1, got {cp!r}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(
                f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}"
            )


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 1
    seed: int = 1234
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
    ckpt_format: str = "megalite"  # issue 18: megalite (own) | torch | torch_dist (Megatron's)
    # issue 18: loss = token sum / unmasked tokens of the global batch (train_step)
    calculate_per_token_loss: bool = False
    # issue 18: batch-size schedules (megalite.training.microbatches) and the sample budget
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
        at_least(0, ("seed", self.seed))
        self.num_microbatches(1)  # the global batch is whole micro-batches
        at_least(1, ("save_interval", self.save_interval))
        at_least(1, ("keep_last_n_checkpoints", self.keep_last_n_checkpoints))
        at_least(1, ("exit_interval", self.exit_interval))
        at_least(0, ("ckpt_step", self.ckpt_step))
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError(
                f"exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}"
            )
        for name, value in (
            ("save_interval", self.save_interval),
            ("keep_last_n_checkpoints", self.keep_last_n_checkpoints),
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
        except ValueError as e:  # signals.py speaks of the flag; this is the field
            raise ConfigError(str(e).replace("--exit-signal", "exit_signal")) from None


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    peak_tflops: float | None = None
    log_num_zeros_in_grad: bool = False

    def validate(self) -> None:
        at_least(1, ("log_interval", self.log_interval))
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
    tokenizer: object = field(default=None, repr=False, compare=False)  # with_tokenizer sets it

    @property
    def num_microbatches(self) -> int:
        """For the world this config was parsed for (``parallel.world_size``); a run takes
        ``check_world(ps.world_size, ps.dp_size)``, which counts them from the mesh."""
        dp = self.parallel.data_parallel_size
        if dp is None:
            raise ConfigError(
                "this config records no world size; use training.num_microbatches(dp_size) "
                "with the mesh's data-parallel size"
            )
        return self.training.num_microbatches(dp)

    def validate(self) -> None:
        """Each concern's ``validate``, then the rules that join them. One-line ConfigError.
        A ``model.vocab_size`` still ``VOCAB_FROM_TOKENIZER`` passes (``with_tokenizer`` sets it;
        the model refuses to be built without it)."""
        par, m, t = self.parallel, self.model, self.training
        par.validate()
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
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
            t.num_microbatches(par.data_parallel_size)  # issue 15: world / (tp x pp x cp)
        _check_cp(par, m)  # issue 15
        check_pipeline_config(self)
        self.optimizer.validate(train_iters=t.train_iters)
        self.logging.validate()
        for what, a, b in (
            ("seq_length", m.seq_length, self.data.seq_length),
            ("seed", t.seed, self.data.seed),
        ):
            if a != b:
                raise ConfigError(f"data.{what} {b} differs from the model's {what} {a}; set both")
        if m.seed != t.seed:
            raise ConfigError(f"model.seed {m.seed} differs from training.seed {t.seed}; set both")
        if m.params_dtype != self.optimizer.params_dtype:
            raise ConfigError(
                f"model.params_dtype {m.params_dtype} does not match the optimizer's precision "
                f"({self.optimizer.precision_name}); set bf16/fp16 and params_dtype together"
            )
        if m.sequence_parallel != par.sequence_parallel:
            raise ConfigError(
                f"model.sequence_parallel {m.sequence_parallel} differs from "
                f"parallel.sequence_parallel {par.sequence_parallel}; set both"
            )
        self._validate_experts()  # issue 16
        if self.data.reset_attention_mask and par.context_parallel_size > 1:  # issue 18
            raise ConfigError(
                f"reset_attention_mask with context_parallel_size {par.context_parallel_size} is "
                "not implemented (the context-parallel attention has no document mask); drop one"
            )
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and vocab != m.vocab_size:
            raise ConfigError(
                f"model.vocab_size {m.vocab_size} differs from the tokenizer's {vocab}; build "
                "the config with with_tokenizer()"
            )

    def _validate_experts(self) -> None:
        """Issue 16: the expert-parallel sizes against the model and the world (one line)."""
        from megalite.models.moe_config import check_moe_parallel

        par = self.parallel
        ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
        etp = par.tensor_model_parallel_size if etp is None else etp
        for name, value in (("expert_model_parallel_size", ep),
                            ("expert_tensor_parallel_size", etp)):  # fmt: skip
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
        mp = self.parallel.model_parallel_size * self.parallel.context_parallel_size  # issue 15
        if mp * dp_size != world_size:
            raise ConfigError(
                f"the mesh's data-parallel size {dp_size} x tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size {mp} is not the world "
                f"size {world_size}"
            )
        return self.training.num_microbatches(dp_size)


def _check_cp(par: ParallelConfig, m: GPTConfig) -> None:  # issue 15
    """The sequence and heads a context-parallel split needs (one-line ConfigError)."""
    cp, tp = par.context_parallel_size, par.tensor_model_parallel_size
    if m.cp_comm_type != par.cp_comm_type:
        raise ConfigError(
            f"model.cp_comm_type {m.cp_comm_type!r} differs from parallel.cp_comm_type "
            f"{par.cp_comm_type!r}; set both"
        )
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"seq_length {m.seq_length} is not divisible by 2 x context_parallel_size {cp} = "
            f"{2 * cp} (each cp rank holds 2 of the 2 x CP chunks); use a multiple of {2 * cp}"
        )
    if par.sequence_parallel and (m.seq_length // cp) % tp:
        raise ConfigError(
            f"seq_length {m.seq_length} / context_parallel_size {cp} is not divisible by "
            f"tensor_model_parallel_size {tp} under sequence_parallel; use a multiple of "
            f"{cp * tp}"
        )
    if par.cp_comm_type == "a2a" and m.num_attention_heads % (tp * cp):
        raise ConfigError(
            f"num_attention_heads {m.num_attention_heads} is not divisible by "
            f"tensor_model_parallel_size {tp} x context_parallel_size {cp} = {tp * cp} "
            f"(cp_comm_type a2a splits the heads); use cp_comm_type p2p or a multiple of "
            f"{tp * cp} heads"
        )


def with_tokenizer(cfg: PretrainConfig) -> PretrainConfig:
    """``cfg`` with its tokenizer built (``megalite.data.tokenizers``; loads the model file of a
    SentencePiece / HuggingFace tokenizer) and ``model.vocab_size`` filled from it, validated.
    A config whose tokenizer is set already is only validated."""
    from megalite.data.tokenizers import build_tokenizer

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
