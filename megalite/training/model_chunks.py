"""This rank's GPT model chunks for a pipeline schedule, and how they share one grad wrapper.

Which layers a chunk holds follows the global stage it runs (``actions.StageLayout``):
- loop layout (1F1B, GPipe, interleaved, ZB-H1): Megatron's assignment, chunk c of rank r holds
  the ``(c * p + r)``-th block (``stages.chunk_layer_ranges``), so checkpoints carry over;
- V layout (ZBV, DualPipeV): chunk 0 of rank r is stage r, chunk 1 is stage ``2p - 1 - r``; the
  layers are cut into ``2p`` blocks in stage order (uneven first/last counts apply to stages 0
  and ``2p - 1``).
Stage 0 embeds (``pre_process``), the last stage holds the output layer and loss
(``post_process``). Tied embeddings: when both live on one rank (a V puts them on rank 0) the
output layer uses the embedding's own Parameter (``GPTModel.borrow_embedding``); otherwise the
last stage holds a copy whose grad is summed over the embedding group, as with 1F1B.

Several chunks on a rank are wrapped by one data-parallel wrapper over a ``ModelChunks`` container
(one grad buffer, one optimizer); the schedule sees a ``ChunkView`` per chunk, whose ``no_sync``
is the wrapper's. One chunk is wrapped directly, as before.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.actions import StageLayout
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.core.pipeline_parallel.stages import chunk_layer_ranges
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel


def stage_blocks(config: GPTConfig, layout: StageLayout) -> list[tuple[int, int]]:
    """``[start, end)`` layers of every global stage, stage order."""
    p, v = layout.pp_size, layout.num_chunks
    first = config.decoder_first_pipeline_num_layers if p > 1 else None
    last = config.decoder_last_pipeline_num_layers if p > 1 else None
    if layout.shape == "v":
        ranges = chunk_layer_ranges(
            config.num_layers, layout.num_stages, first_stage_layers=first, last_stage_layers=last
        )
        return [r[0] for r in ranges]
    ranges = chunk_layer_ranges(
        config.num_layers, p, num_virtual_stages=v, first_stage_layers=first, last_stage_layers=last
    )
    return [ranges[s % p][s // p] for s in range(layout.num_stages)]


def build_gpt_chunks(
    config: GPTConfig,
    ps: ParallelState,
    *,
    schedule: str = "1f1b",
    num_chunks: int = 1,
    rng_tracker: RNGStatesTracker | None = None,
    device: torch.device | None = None,
) -> list[GPTModel]:
    """This rank's chunks, chunk 0 first."""
    layout = layout_of(schedule, ps.pp_size, num_chunks)
    blocks = stage_blocks(config, layout)
    last = layout.num_stages - 1
    chunks = []
    for c in range(layout.num_chunks):
        s = layout.stage(ps.pp_rank, c)
        chunks.append(
            GPTModel(
                config,
                ps,
                pre_process=s == 0,
                post_process=s == last,
                layer_range=blocks[s],
                rng_tracker=rng_tracker,
                device=device,
            )  # fmt: skip
        )
    first_chunk = next((m for m in chunks if m.pre_process), None)
    loss_chunk = next((m for m in chunks if m.post_process), None)
    if first_chunk is not None and loss_chunk is not None and first_chunk is not loss_chunk:
        if loss_chunk.tied:
            loss_chunk.borrow_embedding(first_chunk)
    return chunks


def tied_params(chunks: list[GPTModel], ps: ParallelState) -> tuple[list, list]:
    """(params whose grads are summed over the embedding group, params not counted in the grad
    norm): the tied word embedding and its copy, when they live on different ranks."""
    shared, duplicates = [], []
    borrowed = any(m.post_process and m.tied and m.output_layer.weight is None for m in chunks)
    if ps.pp_size == 1 or borrowed:  # one Parameter on this rank (PP 1, or a V's rank 0)
        return shared, duplicates
    for m in chunks:
        w = m.shared_embedding_or_output_weight()
        if w is None:
            continue
        shared.append(w)
        if not m.pre_process:
            duplicates.append(w)
    return shared, duplicates


class ModelChunks(nn.Module):
    """The chunks of one rank as one module (for one grad wrapper and one optimizer)."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def shared_embedding_or_output_weight(self):
        return None


class ChunkView:
    """Chunk ``index`` of a wrapper over ``ModelChunks``, as the schedule sees it: calling it runs
    the chunk, ``no_sync`` is the wrapper's, ``module`` is the GPT chunk."""

    def __init__(self, wrapper: nn.Module, index: int):
        self.wrapper, self.index = wrapper, index
        self.module = wrapper.module.chunks[index]

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager:
        return self.wrapper.no_sync()

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def modules(self):
        return self.module.modules()


def schedule_chunks(wrapper: nn.Module) -> list:
    """The list of chunks the schedule runs: the wrapper itself for one chunk, else a view per
    chunk of its ``ModelChunks``."""
    if isinstance(getattr(wrapper, "module", None), ModelChunks):
        return [ChunkView(wrapper, c) for c in range(len(wrapper.module.chunks))]
    return [wrapper]


def grad_wrappers(model: list) -> list[nn.Module]:
    """The distinct grad wrappers behind a list of chunks (views share one)."""
    out, seen = [], set()
    for chunk in model:
        w = getattr(chunk, "wrapper", chunk)
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def num_model_chunks(cfg) -> int:
    """Chunks per rank for ``cfg`` (a ``PretrainConfig``): 2 for the V schedules, else the
    virtual stages from ``--num-virtual-stages-per-pipeline-rank`` or
    ``--num-layers-per-virtual-pipeline-stage`` (1 without them)."""
    par, m = cfg.parallel, cfg.model
    if par.pipeline_schedule in ("zbv", "dualpipev"):
        return 2
    if par.num_virtual_stages_per_pipeline_rank is not None:
        return par.num_virtual_stages_per_pipeline_rank
    if par.num_layers_per_virtual_pipeline_stage is not None:
        per_rank = m.num_layers // par.pipeline_model_parallel_size
        return per_rank // par.num_layers_per_virtual_pipeline_stage
    return 1


def check_pipeline_config(cfg) -> None:
    """Megatron's virtual-stage constraints and each schedule's, as one-line ConfigErrors."""
    from megalite.core.pipeline_parallel.generators import check_schedule
    from megalite.training.config import ConfigError

    par, m = cfg.parallel, cfg.model
    pp, sched = par.pipeline_model_parallel_size, par.pipeline_schedule
    per_stage, v_flag = (
        par.num_layers_per_virtual_pipeline_stage,
        par.num_virtual_stages_per_pipeline_rank,
    )
    if per_stage is not None and v_flag is not None:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are mutually exclusive; give one"
        )
    if per_stage is not None:
        if per_stage < 1:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {per_stage}"
            )
        per_rank = m.num_layers // pp
        if m.num_layers % pp or per_rank % per_stage:
            raise ConfigError(
                f"--num-layers {m.num_layers} / --pipeline-model-parallel-size {pp} = "
                f"{m.num_layers / pp:g} layers per rank is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_stage}"
            )
    if v_flag is not None and v_flag < 1:
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {v_flag}")
    v = num_model_chunks(cfg)
    if sched in ("zbv", "dualpipev") and v_flag is not None:
        v = v_flag  # a V holds exactly 2: check_schedule names any other number
    if pp == 1:
        if sched not in ("1f1b", "gpipe") or v > 1:
            raise ConfigError(
                f"--pipeline-schedule {sched} with {v} virtual stage(s) needs "
                "--pipeline-model-parallel-size > 1"
            )
        return
    if v > 1 and sched == "1f1b":  # Megatron: virtual stages mean the interleaved schedule
        sched = "interleaved-1f1b"
    g = par.microbatch_group_size_per_virtual_pipeline_stage
    if g is not None and sched != "interleaved-1f1b":
        raise ConfigError(
            "--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved "
            f"schedule only, not --pipeline-schedule {sched}"
        )
    try:
        chunk_layer_ranges(
            m.num_layers, pp, num_virtual_stages=v if sched not in ("zbv", "dualpipev") else 1,
            first_stage_layers=m.decoder_first_pipeline_num_layers,
            last_stage_layers=m.decoder_last_pipeline_num_layers,
        )  # fmt: skip
        if sched in ("zbv", "dualpipev"):
            chunk_layer_ranges(m.num_layers, 2 * pp)
        dp = par.data_parallel_size
        mb = cfg.training.num_microbatches(dp) if dp is not None else max(pp, 2 * pp)
        check_schedule(
            sched, pp_size=pp, num_microbatches=mb, num_chunks=v, microbatch_group_size=g
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def effective_schedule(cfg) -> str:
    """``--pipeline-schedule``, with Megatron's rule that virtual stages under the default 1F1B
    mean the interleaved schedule."""
    sched = cfg.parallel.pipeline_schedule
    if sched == "1f1b" and num_model_chunks(cfg) > 1:
        return "interleaved-1f1b"
    return sched
