"""Build the model stage, its data-parallel wrapper, the optimizer and the LR schedule from a
``PretrainConfig`` and a ``ParallelState``.

Works unchanged with ``ParallelState.single()`` (every group None): that is how the tests build the
single-process oracle next to the sharded run.
"""

from __future__ import annotations

from functools import partial

import torch

from megalite.core.distributed import DistributedDataParallel, ParamOffloadSpec, wrapper_class
from megalite.core.distributed.deferred_init import is_released, release_params
from megalite.core.optimizer import (
    ConstantLossScaler,
    DynamicLossScaler,
    LossScaler,
    MixedPrecisionOptimizer,
    OffloadSpec,
    build_optimizer,
    build_sharded_optimizer,
)
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.gpt import GPTModel
from megalite.training.config import PretrainConfig
from megalite.training.lr_scheduler import LRScheduler
from megalite.training.model_chunks import (
    ModelChunks,
    build_gpt_chunks,
    tied_params,
)
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.pipeline_config import effective_schedule, num_model_chunks


def build_loss_scaler(
    opt: OptimizerConfig, *, params_dtype: torch.dtype, device: torch.device
) -> LossScaler | None:
    """fp16 parameters only: ``--loss-scale S`` constant, else dynamic. None for bf16 and fp32."""
    if params_dtype != torch.float16:
        return None
    if opt.loss_scale is not None:
        return ConstantLossScaler(opt.loss_scale, device=device)
    return DynamicLossScaler(
        opt.initial_loss_scale,
        min_scale=opt.min_loss_scale,
        window=opt.loss_scale_window,
        hysteresis=opt.hysteresis,
        device=device,
    )


def build_model(
    cfg: PretrainConfig,
    ps: ParallelState,
    *,
    device: torch.device,
    rng_tracker: RNGStatesTracker | None,
) -> GPTModel | ModelChunks:
    """This rank's pipeline stage of the GPT model (the whole model when PP = 1); with several
    chunks per rank (virtual stages, V schedules) a ``ModelChunks`` of them. ZeRO-3 with its
    param shards offloaded and one chunk: built on the meta device, its parameters without bytes
    (``deferred_init``), filled one unit at a time as ZeRO-3 writes the shards."""
    deferred = builds_deferred(cfg)
    chunks = build_gpt_chunks(
        cfg.model,
        ps,
        schedule=effective_schedule(cfg),
        num_chunks=num_model_chunks(cfg),
        rng_tracker=rng_tracker,
        device=torch.device("meta") if deferred else device,
    )
    if deferred:
        release_params(chunks[0], device)
    return chunks[0] if len(chunks) == 1 else ModelChunks(chunks)


def builds_deferred(cfg: PretrainConfig) -> bool:
    """Whether ``build_model`` leaves the values to ZeRO-3 (param offload, one model chunk)."""
    par = cfg.parallel
    zero3 = par.sharding_strategy() == "optim_grads_params"
    return zero3 and par.param_offload and num_model_chunks(cfg) == 1


def tied_embedding_params(model: GPTModel, ps: ParallelState) -> tuple[list, list]:
    """(params whose grads are summed over the embedding group, params not counted in the grad
    norm): with PP > 1 and tied embeddings, the first and last stage each hold the word embedding;
    the last stage's copy is the duplicate. Both empty when PP = 1 (one shared Parameter)."""
    if isinstance(model, ModelChunks):
        return tied_params(list(model.chunks), ps)
    shared = model.shared_embedding_or_output_weight()
    if shared is None or ps.pp_size == 1:
        return [], []
    duplicates = [shared] if not ps.is_first_stage else []
    return [shared], duplicates


def offload_spec(par) -> OffloadSpec | None:
    """``--optimizer-cpu-offload`` / ``--optimizer-offload-dir`` as an ``OffloadSpec`` (None: the
    optimizer state stays on the device)."""
    if not par.offload:
        return None
    return OffloadSpec(
        fraction=par.optimizer_offload_fraction,
        directory=par.optimizer_offload_dir,
        host_bytes=int(par.optimizer_offload_host_memory_mb * 2**20),
    )


def param_offload_spec(par) -> ParamOffloadSpec | None:
    """``--param-cpu-offload`` / ``--param-offload-dir`` as a ``ParamOffloadSpec`` (None: ZeRO-3's
    param shards stay on the device)."""
    if not par.param_offload:
        return None
    return ParamOffloadSpec(
        directory=par.param_offload_dir,
        host_bytes=int(par.param_offload_host_memory_mb * 2**20),
    )


def gpt_units(model: GPTModel) -> tuple[list, dict]:
    """ZeRO-3's gather units of a GPT stage, forward order: the embedding, each transformer
    layer, the final norm, the output layer; and the output layer's extra (the tied word embedding
    it reads when this stage also holds the embedding)."""
    units = [model.embedding, *model.decoder.layers, model.decoder.final_layernorm]
    units += [model.output_layer]
    units = [u for u in units if u is not None]
    extras = {}
    if model.output_layer is not None and model.output_layer.weight is None:
        extras[model.output_layer] = [model.embedding.word_embeddings.weight]
    return units, extras


def wrap_and_build_optimizer(
    module: torch.nn.Module,
    ps: ParallelState,
    *,
    strategy: str = "no_shard",
    shared_params=(),
    duplicates=(),
    accumulate_allreduce_grads_in_fp32: bool = False,
    bucket_size: int | None = None,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    units=None,
    unit_extras=None,
    param_offload: ParamOffloadSpec | None = None,
    grad_offload: bool = False,
    grad_files: bool = False,
    **optimizer_options,
) -> tuple[DistributedDataParallel, MixedPrecisionOptimizer]:
    """The data-parallel wrapper of ``module`` for the rung ``strategy`` (``no_shard``: DDP,
    ``optim``: ZeRO-1, ``optim_grads``: ZeRO-2, ``optim_grads_params``: ZeRO-3 gathering
    ``units`` / ``unit_extras``, default: ``gpt_units`` for a GPTModel, its shards where
    ``param_offload`` says, its grad shards on the host with ``grad_offload``, in files beside the
    param files with ``grad_files``; a GPTModel whose parameters have no bytes, from
    ``build_model``'s meta build, is filled from ``build_twin`` unit by unit) and its optimizer
    (``build_optimizer``'s keywords in ``optimizer_options``). Dense parameters are reduced over
    ``ps.group("dp", "cp")``, expert ones (``expert_parallel``) over ``ps.group("edp")``; the grad
    norm over ``ps.mp_group`` and ``ps.group("etp", "ep", "pp")``."""
    sharded = strategy != "no_shard"
    wrapper_options = {}
    if sharded:  # the grad hooks start a bucket's reduce-scatter after its last micro-batch
        wrapper_options = {
            "overlap_grad_reduce": overlap_grad_reduce,
            "overlap_param_gather": overlap_param_gather,
        }
    if strategy == "optim_grads_params":
        if units is None and isinstance(module, GPTModel):
            units, unit_extras = gpt_units(module)
        unit_init = None
        if isinstance(module, GPTModel) and any(is_released(p) for p in module.parameters()):
            unit_init = partial(module.build_twin, ps=ps)
        wrapper_options.update(
            units=units,
            unit_extras=unit_extras,
            param_offload=param_offload,
            grad_offload=grad_offload,
            grad_files=grad_files,
            unit_init=unit_init,
        )
    model = wrapper_class(strategy)(
        module,
        dp_group=ps.group("dp", "cp"),
        tp_group=ps.tp_group,
        embedding_group=ps.embedding_group,
        shared_params=shared_params,
        accumulate_allreduce_grads_in_fp32=accumulate_allreduce_grads_in_fp32,
        bucket_size=bucket_size,
        expert_dp_group=ps.group("edp"),  # expert_parallel params: reduced over expert DP
        **wrapper_options,
    )
    optimizer = (build_sharded_optimizer if sharded else build_optimizer)(
        model,
        mp_group=ps.mp_group,
        tp_rank=ps.tp_rank,
        duplicates=duplicates,
        expert_mp_group=ps.group("etp", "ep", "pp"),
        expert_tp_rank=ps.rank("etp"),
        **optimizer_options,
    )
    return model, optimizer


def setup_model_and_optimizer(
    cfg: PretrainConfig,
    ps: ParallelState,
    *,
    device: torch.device,
    rng_tracker: RNGStatesTracker | None = None,
) -> tuple[DistributedDataParallel, MixedPrecisionOptimizer, LRScheduler]:
    """Model stage in ``cfg.model.params_dtype`` wrapped for DP grad sync, AdamW over fp32 masters
    (loss scaler under fp16), and the LR schedule (already applied to the optimizer)."""
    module = build_model(cfg, ps, device=device, rng_tracker=rng_tracker)
    shared, duplicates = tied_embedding_params(module, ps)
    par, opt = cfg.parallel, cfg.optimizer
    model, optimizer = wrap_and_build_optimizer(
        module,
        ps,
        strategy=par.sharding_strategy(),
        shared_params=shared,
        duplicates=duplicates,
        accumulate_allreduce_grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        bucket_size=par.bucket_size(
            ps.dp_size,
            stage_numel=sum(p.numel() for p in module.parameters()),  # --ddp-num-buckets
        ),
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        param_offload=param_offload_spec(par),
        grad_offload=par.grad_offload,
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        loss_scaler=build_loss_scaler(opt, params_dtype=cfg.model.params_dtype, device=device),
        count_zeros=cfg.logging.log_num_zeros_in_grad,
        offload=offload_spec(par),
        decoupled_lr=opt.decoupled_lr,
        decoupled_min_lr=opt.decoupled_min_lr,
        optimizer=opt.optimizer,
        compression=opt.compression(),
        lamb_trust_ratio=(opt.lamb_min_trust_ratio, opt.lamb_max_trust_ratio),
    )
    decay_iters = opt.lr_decay_iters or cfg.training.train_iters
    scheduler = LRScheduler(
        optimizer,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        warmup_iters=opt.warmup_iters(decay_iters),
        decay_iters=decay_iters,
        decay_style=opt.lr_decay_style,
        warmup_init=opt.lr_warmup_init,
        samples_per_step=cfg.training.global_batch_size,
    )
    return model, optimizer, scheduler
