"""The pipeline settings of a ``PretrainConfig``: chunks per rank, the schedule that runs, and the
constraints of virtual stages and of each schedule, checked once as one-line ConfigErrors.

    num_model_chunks(cfg)      # 2 for a V schedule, else the virtual stages per rank (1 without)
    effective_schedule(cfg)    # "1f1b" with virtual stages means "interleaved-1f1b" (Megatron)
    check_pipeline_config(cfg) # from PretrainConfig.validate

``cfg`` is a ``PretrainConfig`` (its ``parallel``, ``model`` and ``training`` parts); this module
imports only core and the error type, so ``config.py`` imports it and not the other way round.
Messages name the config fields; the flag layer writes them as flags.
"""

from __future__ import annotations

from megalite.core.pipeline_parallel.generators import V_SHAPED, check_schedule
from megalite.core.pipeline_parallel.stages import chunk_layer_ranges
from megalite.errors import ConfigError


def num_model_chunks(cfg) -> int:
    """Chunks per rank: 2 for the V schedules, else the virtual stages from
    ``num_virtual_stages_per_pipeline_rank`` or ``num_layers_per_virtual_pipeline_stage`` (1
    without them)."""
    par, m = cfg.parallel, cfg.model
    if par.pipeline_schedule in V_SHAPED:
        return 2
    if par.num_virtual_stages_per_pipeline_rank is not None:
        return par.num_virtual_stages_per_pipeline_rank
    if par.num_layers_per_virtual_pipeline_stage is not None:
        per_rank = m.num_layers // par.pipeline_model_parallel_size
        return per_rank // par.num_layers_per_virtual_pipeline_stage
    return 1


def effective_schedule(cfg) -> str:
    """``pipeline_schedule``, with Megatron's rule that virtual stages under the default 1F1B
    mean the interleaved schedule."""
    sched = cfg.parallel.pipeline_schedule
    if sched == "1f1b" and num_model_chunks(cfg) > 1:
        return "interleaved-1f1b"
    return sched


def check_pipeline_config(cfg) -> None:
    """Megatron's virtual-stage constraints and each schedule's, as one-line ConfigErrors."""
    par, m = cfg.parallel, cfg.model
    pp, sched = par.pipeline_model_parallel_size, par.pipeline_schedule
    per_stage = par.num_layers_per_virtual_pipeline_stage
    v_given = par.num_virtual_stages_per_pipeline_rank
    _check_virtual_stages(m.num_layers, pp, per_stage, v_given)
    v = num_model_chunks(cfg)
    if sched in V_SHAPED and v_given is not None:
        v = v_given  # a V holds exactly 2: check_schedule names any other number
    if pp == 1:
        if sched not in ("1f1b", "gpipe") or v > 1:
            raise ConfigError(
                f"pipeline_schedule {sched} with {v} virtual stage(s) needs "
                "pipeline_model_parallel_size > 1"
            )
        return
    if v > 1 and sched == "1f1b":  # Megatron: virtual stages mean the interleaved schedule
        sched = "interleaved-1f1b"
    g = par.microbatch_group_size_per_virtual_pipeline_stage
    if g is not None and sched != "interleaved-1f1b":
        raise ConfigError(
            "microbatch_group_size_per_virtual_pipeline_stage applies to the interleaved "
            f"schedule only, not pipeline_schedule {sched}"
        )
    try:
        chunk_layer_ranges(
            m.num_layers,
            pp,
            num_virtual_stages=1 if sched in V_SHAPED else v,
            first_stage_layers=m.decoder_first_pipeline_num_layers,
            last_stage_layers=m.decoder_last_pipeline_num_layers,
        )
        if sched in V_SHAPED:
            chunk_layer_ranges(m.num_layers, 2 * pp)
        dp = par.data_parallel_size
        mb = cfg.training.num_microbatches(dp) if dp is not None else max(pp, 2 * pp)
        check_schedule(
            sched, pp_size=pp, num_microbatches=mb, num_chunks=v, microbatch_group_size=g
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _check_virtual_stages(
    num_layers: int, pp: int, per_stage: int | None, v_given: int | None
) -> None:
    """``num_layers_per_virtual_pipeline_stage`` / ``num_virtual_stages_per_pipeline_rank``:
    at most one, >= 1, and the layers per stage must divide each rank's layers."""
    if per_stage is not None and v_given is not None:
        raise ConfigError(
            "num_layers_per_virtual_pipeline_stage and num_virtual_stages_per_pipeline_rank "
            "are mutually exclusive; give one"
        )
    if per_stage is not None:
        if per_stage < 1:
            raise ConfigError(
                f"num_layers_per_virtual_pipeline_stage must be >= 1, got {per_stage}"
            )
        if num_layers % pp or (num_layers // pp) % per_stage:
            raise ConfigError(
                f"num_layers {num_layers} / pipeline_model_parallel_size {pp} = "
                f"{num_layers / pp:g} layers per rank is not divisible by "
                f"num_layers_per_virtual_pipeline_stage {per_stage}"
            )
    if v_given is not None and v_given < 1:
        raise ConfigError(f"num_virtual_stages_per_pipeline_rank must be >= 1, got {v_given}")
