"""Megatron-LM's command-line flags -> a validated ``PretrainConfig``.

    cfg = parse_args(sys.argv[1:])      # raises ConfigError (one line) on any bad input

Everything is checked here, before any process group exists: the world size comes from the
launcher's environment (``launch.detect_launch``). An unknown flag is an error ("unknown flag --x"),
never ignored; abbreviations of flags are not accepted. The flags megalite accepts but does not
implement yet fail with a clear "not implemented yet" line naming the issue that brings them.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence

from megalite.core.parallel_state import validate_parallel_sizes
from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.data.config import DataConfig
from megalite.data.tokenizers import build_tokenizer
from megalite.models.config import GPTConfig
from megalite.training.config import (
    ConfigError,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    PretrainConfig,
    TrainingConfig,
)
from megalite.training.launch import detect_launch
from megalite.training.lr_schedule import DECAY_STYLES
from megalite.training.signals import parse_signal

logger = logging.getLogger(__name__)

# Megatron's --attention-backend values map onto the two megalite implements.
ATTENTION_BACKEND_ALIASES = {
    "sdpa": "sdpa", "unfused": "unfused", "auto": "sdpa", "flash": "sdpa", "fused": "sdpa",
    "local": "unfused",
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we raise one line
        if message.startswith("the following arguments are required"):
            message = "missing required flag(s): " + message.split(": ", 1)[1]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, description=__doc__.splitlines()[0])
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--kv-channels", type=int)
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--num-query-groups", type=int)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"])  # fmt: skip
    m.add_argument("--rotary-base", type=int, default=10000)
    m.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    m.add_argument("--norm-epsilon", type=float, default=1e-5)
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--openai-gelu", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--label-smoothing", type=float, default=0.0)
    m.add_argument("--attention-backend", default="sdpa", choices=sorted(ATTENTION_BACKEND_ALIASES))
    m.add_argument("--recompute-granularity", choices=["full", "selective"])
    m.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's alias of --recompute-granularity selective")  # fmt: skip
    m.add_argument("--recompute-method", choices=["uniform", "block"])
    m.add_argument("--recompute-num-layers", type=int)
    for flag in ("--no-fused-kernels", "--no-masked-softmax-fusion", "--no-persist-layer-norm"):
        m.add_argument(flag, dest="no_fused_kernels", action="store_true",
                       help="use the PyTorch reference instead of the Triton kernels")  # fmt: skip

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int)
    par.add_argument("--decoder-last-pipeline-num-layers", type=int)
    par.add_argument("--pipeline-schedule", choices=["1f1b", "gpipe"], default="1f1b")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true")
    par.add_argument("--overlap-param-gather", action="store_true")
    par.add_argument("--ddp-bucket-size", type=int)
    par.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    par.add_argument("--distributed-backend", choices=["nccl", "gloo"])
    par.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])

    o = p.add_argument_group("optimizer")
    o.add_argument("--optimizer", default="adam", choices=["adam"])
    o.add_argument("--lr", type=float, required=True)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-decay-style", default="linear", choices=list(DECAY_STYLES))
    o.add_argument("--lr-decay-iters", type=int)
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-warmup-fraction", type=float)
    o.add_argument("--lr-warmup-init", type=float, default=0.0)
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--bf16", action="store_true")
    o.add_argument("--fp16", action="store_true")
    o.add_argument("--loss-scale", type=float)
    o.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    o.add_argument("--min-loss-scale", type=float, default=1.0)
    o.add_argument("--loss-scale-window", type=int, default=1000)
    o.add_argument("--hysteresis", type=int, default=2)

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, required=True)
    t.add_argument("--global-batch-size", type=int)
    t.add_argument("--train-iters", type=int)
    t.add_argument("--train-samples", type=int)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--eval-interval", type=int, default=1000)
    t.add_argument("--eval-iters", type=int, default=100)
    t.add_argument("--check-for-nan-in-loss-and-grad", default=True,
                   action=argparse.BooleanOptionalAction)  # fmt: skip
    t.add_argument("--exit-interval", type=int)
    t.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal: finish the iteration, save, exit 0")  # fmt: skip
    t.add_argument("--exit-signal", default="SIGTERM",
                   help="the signal it catches (SIGTERM, SIGUSR1 ...)")  # fmt: skip
    t.add_argument("--save", help="checkpoint directory to save to")
    t.add_argument("--load", help="checkpoint directory to resume from (any TP/PP/DP layout)")
    t.add_argument("--save-interval", type=int)
    t.add_argument("--ckpt-step", type=int, help="load this iteration instead of the latest")
    t.add_argument("--no-save-optim", action="store_true")
    t.add_argument("--no-load-optim", action="store_true")
    t.add_argument("--no-load-rng", action="store_true")
    t.add_argument("--finetune", action="store_true",
                   help="load the weights only; iteration and data start at 0")  # fmt: skip
    t.add_argument("--exit-duration-in-mins", type=float)
    t.add_argument("--keep-last-n-checkpoints", type=int,
                   help="megalite's own: delete older iter_* folders after each save")  # fmt: skip

    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="*")
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--train-data-path", nargs="*")
    d.add_argument("--valid-data-path", nargs="*")
    d.add_argument("--test-data-path", nargs="*")
    d.add_argument("--data-cache-path")
    d.add_argument("--mock-data", action="store_true")
    d.add_argument("--tokenizer-type", default="NullTokenizer")
    d.add_argument("--tokenizer-model")
    d.add_argument("--vocab-size", type=int)
    d.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    d.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    d.add_argument("--tiktoken-pattern", choices=["v1", "v2"])
    d.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    d.add_argument("--num-workers", type=int, default=0)
    d.add_argument("--eod-mask-loss", action="store_true")

    lg = p.add_argument_group("logging")
    lg.add_argument("--log-interval", type=int, default=100)
    lg.add_argument("--tensorboard-dir")
    lg.add_argument("--tensorboard-log-interval", type=int, default=1)
    lg.add_argument("--tensorboard-queue-size", type=int, default=1000)
    lg.add_argument("--peak-tflops", type=float,
                    help="peak TFLOP/s of one device for MFU (default: GPU table)")  # fmt: skip
    lg.add_argument("--log-num-zeros-in-grad", action="store_true")
    lg.add_argument("--log-throughput", action="store_true",
                    help="accepted for Megatron scripts; throughput is always logged")  # fmt: skip
    return p


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> PretrainConfig:
    """Parse and validate; ``env`` (default ``os.environ``) gives the launcher's world size."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv))
    if unknown:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-") and not _is_number(u)]
        if flags:
            raise ConfigError(
                f"unknown flag {flags[0]}"
                + (f" (also {', '.join(flags[1:])})" if flags[1:] else "")
                + "; see pretrain_gpt.py --help for the flags megalite implements"
            )
        raise ConfigError(f"unexpected argument(s) {' '.join(unknown)}")
    try:
        launch = detect_launch(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return build_config(args, world_size=launch.world_size, rank=launch.rank)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _fail(message: str) -> None:
    raise ConfigError(message)


def _check_unimplemented(a: argparse.Namespace) -> None:
    if a.overlap_param_gather and not a.use_distributed_optimizer:
        _fail(
            "--overlap-param-gather needs --use-distributed-optimizer (it overlaps ZeRO-1's "
            "parameter all-gather with the next forward); add it or drop the flag"
        )
    if a.overlap_grad_reduce and not a.use_distributed_optimizer:
        _fail(
            "--overlap-grad-reduce is implemented for --use-distributed-optimizer only; add it, "
            "or drop --overlap-grad-reduce (the all-reduce then runs after backward)"
        )
    _check_checkpointing(a)


def _check_checkpointing(a: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--save-interval", a.save_interval, 1),
        ("--keep-last-n-checkpoints", a.keep_last_n_checkpoints, 1),
        ("--exit-interval", a.exit_interval, 1),
        ("--ckpt-step", a.ckpt_step, 0),
    ):
        if value is not None and value < low:
            _fail(f"{flag} must be >= {low}, got {value}")
    if a.exit_duration_in_mins is not None and a.exit_duration_in_mins <= 0:
        _fail(f"--exit-duration-in-mins must be > 0, got {a.exit_duration_in_mins}")
    for flag, value in (("--save-interval", a.save_interval),
                        ("--keep-last-n-checkpoints", a.keep_last_n_checkpoints)):  # fmt: skip
        if value is not None and a.save is None:
            _fail(f"{flag} {value} needs --save DIR (where to write checkpoints)")
    for flag, value in (("--ckpt-step", a.ckpt_step), ("--finetune", a.finetune or None),
                        ("--no-load-optim", a.no_load_optim or None),
                        ("--no-load-rng", a.no_load_rng or None)):  # fmt: skip
        if value is not None and a.load is None:
            _fail(f"{flag} needs --load DIR (the checkpoint to load)")


def _check_training(a: argparse.Namespace, dp: int) -> tuple[int, int]:
    """Return (global_batch_size, train_iters)."""
    for flag, value, low in (
        ("--micro-batch-size", a.micro_batch_size, 1),
        ("--log-interval", a.log_interval, 1),
        ("--tensorboard-log-interval", a.tensorboard_log_interval, 1),
        ("--eval-interval", a.eval_interval, 0),
        ("--eval-iters", a.eval_iters, 0),
        ("--loss-scale-window", a.loss_scale_window, 1),
        ("--hysteresis", a.hysteresis, 1),
        ("--lr-warmup-iters", a.lr_warmup_iters, 0),
        ("--seed", a.seed, 0),
    ):
        if value < low:
            _fail(f"{flag} must be >= {low}, got {value}")
    gbs = a.global_batch_size if a.global_batch_size is not None else a.micro_batch_size * dp
    if gbs < 1 or gbs % (a.micro_batch_size * dp):
        _fail(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{a.micro_batch_size} x data-parallel size {dp} = {a.micro_batch_size * dp}; use a "
            f"multiple of {a.micro_batch_size * dp}"
        )
    if (a.train_iters is None) == (a.train_samples is None):
        _fail("give exactly one of --train-iters and --train-samples")
    if a.train_samples is not None:
        if a.train_samples < gbs:
            _fail(f"--train-samples {a.train_samples} is less than one global batch ({gbs})")
        train_iters = a.train_samples // gbs
    else:
        train_iters = a.train_iters
    if train_iters < 1:
        _fail(f"--train-iters must be >= 1, got {train_iters}")
    return gbs, train_iters


def _check_optimizer(a: argparse.Namespace, train_iters: int, *, warn: bool) -> None:
    if a.fp16 and a.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive; choose one")
    if a.lr < 0 or a.min_lr < 0 or a.min_lr > a.lr:
        _fail(f"need 0 <= --min-lr ({a.min_lr}) <= --lr ({a.lr})")
    if a.lr_warmup_fraction is not None:
        if a.lr_warmup_iters:
            _fail("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive; choose one")
        if not 0.0 <= a.lr_warmup_fraction <= 1.0:
            _fail(f"--lr-warmup-fraction must be in [0, 1], got {a.lr_warmup_fraction}")
    decay = a.lr_decay_iters if a.lr_decay_iters is not None else train_iters
    if decay < 1:
        _fail(f"--lr-decay-iters must be >= 1, got {decay}")
    if a.lr_warmup_iters > decay:
        _fail(
            f"--lr-warmup-iters {a.lr_warmup_iters} exceeds --lr-decay-iters {decay}"
            + ("" if a.lr_decay_iters is not None else " (= --train-iters)")
            + "; shorten the warmup or lengthen the decay"
        )
    if a.clip_grad < 0 or a.weight_decay < 0:
        _fail(f"--clip-grad ({a.clip_grad}) and --weight-decay ({a.weight_decay}) must be >= 0")
    if not (0 <= a.adam_beta1 < 1 and 0 <= a.adam_beta2 < 1 and a.adam_eps > 0):
        _fail(
            f"need 0 <= --adam-beta1 ({a.adam_beta1}), --adam-beta2 ({a.adam_beta2}) < 1 and "
            f"--adam-eps ({a.adam_eps}) > 0"
        )
    if a.loss_scale is not None and a.loss_scale <= 0:
        _fail(f"--loss-scale must be > 0, got {a.loss_scale}")
    if a.initial_loss_scale < a.min_loss_scale or a.min_loss_scale <= 0:
        _fail(
            f"need 0 < --min-loss-scale ({a.min_loss_scale}) <= --initial-loss-scale "
            f"({a.initial_loss_scale})"
        )
    if warn and not a.fp16 and a.loss_scale is not None:
        logger.warning("--loss-scale applies to --fp16 only; it is ignored in this run")


def _with_exit_signal(a: argparse.Namespace, training: TrainingConfig) -> TrainingConfig:
    """Attach ``exit_signal_handler`` / ``exit_signal`` (megalite.training.signals) to ``training``;
    the signal name is checked here, before any process starts."""
    try:
        signum = parse_signal(a.exit_signal)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    training.exit_signal_handler = a.exit_signal_handler
    training.exit_signal = signum.name
    return training


def build_config(a: argparse.Namespace, *, world_size: int, rank: int = 0) -> PretrainConfig:
    """Turn parsed flags into a ``PretrainConfig``, checking every combination (warnings are
    logged on ``rank`` 0 only, once per job)."""
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    try:
        dp = validate_parallel_sizes(world_size, tp, pp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if a.num_layers >= 1:
        try:  # every stage must get a whole, positive number of layers
            stage_layer_ranges(
                a.num_layers,
                pp,
                first_stage_layers=a.decoder_first_pipeline_num_layers,
                last_stage_layers=a.decoder_last_pipeline_num_layers,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check_unimplemented(a)
    gbs, train_iters = _check_training(a, dp)
    _check_optimizer(a, train_iters, warn=rank == 0)
    if a.distributed_backend is not None:
        wanted = "cuda" if a.distributed_backend == "nccl" else "cpu"
        if a.device not in ("auto", wanted):
            _fail(
                f"--distributed-backend {a.distributed_backend} does not run on --device {a.device}"
            )
        a.device = wanted
    if a.distributed_timeout_minutes <= 0:
        _fail(f"--distributed-timeout-minutes must be > 0, got {a.distributed_timeout_minutes}")
    if a.ddp_bucket_size is not None and a.ddp_bucket_size < 1:
        _fail(f"--ddp-bucket-size must be >= 1 element, got {a.ddp_bucket_size}")

    sequence_parallel = a.sequence_parallel
    if sequence_parallel and tp == 1:
        if rank == 0:
            logger.warning(
                "--sequence-parallel has no effect with --tensor-model-parallel-size 1; off"
            )
        sequence_parallel = False
    if a.num_query_groups is not None and not a.group_query_attention:
        _fail("--num-query-groups needs --group-query-attention (or drop --num-query-groups)")
    if a.group_query_attention and a.num_query_groups is None:
        _fail("--group-query-attention needs --num-query-groups N")
    granularity = a.recompute_granularity
    if a.recompute_activations:
        if granularity not in (None, "selective"):
            _fail("--recompute-activations means selective; it conflicts with "
                  f"--recompute-granularity {granularity}")  # fmt: skip
        granularity = "selective"

    data = DataConfig(
        data_path=a.data_path,
        split=a.split,
        train_data_path=a.train_data_path,
        valid_data_path=a.valid_data_path,
        test_data_path=a.test_data_path,
        data_cache_path=a.data_cache_path,
        mock_data=a.mock_data,
        tokenizer_type=a.tokenizer_type,
        tokenizer_model=a.tokenizer_model,
        vocab_size=a.vocab_size,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
        tiktoken_pattern=a.tiktoken_pattern,
        tiktoken_num_special_tokens=a.tiktoken_num_special_tokens,
        seq_length=a.seq_length,
        seed=a.seed,
        num_workers=a.num_workers,
        eod_mask_loss=a.eod_mask_loss,
    )
    try:
        data.validate()
        tokenizer = build_tokenizer(data)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None

    optimizer = OptimizerConfig(
        lr=a.lr, min_lr=a.min_lr, lr_decay_style=a.lr_decay_style,
        lr_decay_iters=a.lr_decay_iters if a.lr_decay_iters is not None else train_iters,
        lr_warmup_iters=a.lr_warmup_iters, lr_warmup_fraction=a.lr_warmup_fraction,
        lr_warmup_init=a.lr_warmup_init, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
        adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, bf16=a.bf16,
        fp16=a.fp16, loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
        min_loss_scale=a.min_loss_scale, loss_scale_window=a.loss_scale_window,
        hysteresis=a.hysteresis,
    )  # fmt: skip
    try:
        model = GPTConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size,
            num_attention_heads=a.num_attention_heads, vocab_size=tokenizer.vocab_size,
            seq_length=a.seq_length, max_position_embeddings=a.max_position_embeddings,
            ffn_hidden_size=a.ffn_hidden_size, num_query_groups=a.num_query_groups,
            kv_channels=a.kv_channels, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
            normalization=a.normalization, norm_epsilon=a.norm_epsilon, swiglu=a.swiglu,
            openai_gelu=a.openai_gelu, add_bias_linear=not a.disable_bias_linear,
            untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
            hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
            init_method_std=a.init_method_std,
            attention_backend=ATTENTION_BACKEND_ALIASES[a.attention_backend],
            recompute_granularity=granularity, recompute_method=a.recompute_method,
            recompute_num_layers=a.recompute_num_layers, sequence_parallel=sequence_parallel,
            decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers,
            use_fused_kernels=not a.no_fused_kernels, label_smoothing=a.label_smoothing,
            params_dtype=optimizer.params_dtype, seed=a.seed,
        )  # fmt: skip
        model.validate(tp_size=tp, pp_size=pp)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    return PretrainConfig(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            pipeline_schedule=a.pipeline_schedule,
            sequence_parallel=sequence_parallel,
            use_distributed_optimizer=a.use_distributed_optimizer,
            ddp_bucket_size=a.ddp_bucket_size,
            accumulate_allreduce_grads_in_fp32=a.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=a.overlap_grad_reduce,
            overlap_param_gather=a.overlap_param_gather,
            distributed_timeout_minutes=a.distributed_timeout_minutes,
            device=a.device,
            world_size=world_size,
        ),
        optimizer=optimizer,
        data=data,
        training=_with_exit_signal(
            a,
            TrainingConfig(
                micro_batch_size=a.micro_batch_size,
                global_batch_size=gbs,
                train_iters=train_iters,
                seed=a.seed,
                eval_interval=a.eval_interval,
                eval_iters=a.eval_iters,
                check_for_nan_in_loss_and_grad=a.check_for_nan_in_loss_and_grad,
                exit_interval=a.exit_interval,
                save=a.save,
                load=a.load,
                save_interval=a.save_interval,
                ckpt_step=a.ckpt_step,
                no_save_optim=a.no_save_optim,
                no_load_optim=a.no_load_optim,
                no_load_rng=a.no_load_rng,
                finetune=a.finetune,
                exit_duration_in_mins=a.exit_duration_in_mins,
                keep_last_n_checkpoints=a.keep_last_n_checkpoints,
            ),
        ),
        logging=LoggingConfig(
            log_interval=a.log_interval,
            tensorboard_dir=a.tensorboard_dir,
            tensorboard_log_interval=a.tensorboard_log_interval,
            tensorboard_queue_size=a.tensorboard_queue_size,
            peak_tflops=a.peak_tflops,
            log_num_zeros_in_grad=a.log_num_zeros_in_grad,
        ),
        tokenizer=tokenizer,
    )
