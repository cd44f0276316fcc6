"""The prediction for one layout of one run: per-rank model state and activations, from a config.

``predict_memory(cfg, layout)`` joins ``model_state`` and ``activations`` for every pipeline rank;
``layout_of(cfg, world_size)`` reads the layout a ``PretrainConfig`` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.optimizer.memory_report import ModelStateBytes
from megalite.planning.activations import StageActivations, stage_activations
from megalite.planning.model_state import model_state_bytes


@dataclass(frozen=True)
class Layout:
    """One parallel layout with its batch split and memory options (pretrain_gpt.py's flags)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    rung: str = "no_shard"  # a ZERO_RUNGS key
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    recompute: str | None = None  # None | "selective" | "full"
    cp: int = 1  # issue 15
    ep: int = 1  # issue 16
    vp: int = 1  # issue 14: virtual stages per pipeline rank

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of this layout."""
        from megalite.planning.model_state import ZERO_RUNGS

        out = [
            "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp),
            "--micro-batch-size", str(self.micro_batch_size),
        ]  # fmt: skip
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.pp > 1 and self.schedule != "1f1b":
            out += ["--pipeline-schedule", self.schedule]
        out += list(ZERO_RUNGS[self.rung].flags)
        if self.rung != "no_shard":  # hide the grad reduce-scatter / param all-gather
            out += ["--overlap-grad-reduce", "--overlap-param-gather"]
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"]  # fmt: skip
        return out

    def name(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.pp > 1:
            parts.append(self.schedule)
        if self.rung != "no_shard":
            parts.append(self.rung)
        parts.append(f"mbs{self.micro_batch_size}")
        if self.recompute:
            parts.append(f"rc-{self.recompute}")
        return " ".join(parts)


def layout_of(cfg, *, dp: int) -> Layout:
    """The layout a ``PretrainConfig`` runs with on a mesh of data-parallel size ``dp``."""
    par, m = cfg.parallel, cfg.model
    return Layout(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        dp=dp,
        sequence_parallel=m.sequence_parallel,
        rung="optim" if par.use_distributed_optimizer else "no_shard",
        schedule=par.pipeline_schedule,
        micro_batch_size=cfg.training.micro_batch_size,
        recompute=m.recompute_granularity,
    )


@dataclass
class RankMemory:
    """Predicted bytes of one rank (pipeline rank ``pp_rank``, DP rank ``dp_rank``)."""

    pp_rank: int
    dp_rank: int
    state: ModelStateBytes
    activations: StageActivations

    @property
    def total(self) -> int:
        return self.state.total + self.activations.peak


def predict_memory(
    cfg,
    layout: Layout,
    *,
    global_batch_size: int,
    precision: str,
    bucket_size: int | None,
    grads_in_fp32: bool = False,
    dp_ranks: list[int] | None = None,
    device: str = "cuda",
) -> list[RankMemory]:
    """Every pipeline rank's prediction (on DP ranks ``dp_ranks``, default 0 only): ``cfg`` is the
    ``GPTConfig`` with the layout's model options (sequence parallel, recompute) set."""
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    out = []
    for pp_rank in range(layout.pp):
        acts = stage_activations(
            cfg,
            micro_batch_size=layout.micro_batch_size,
            tp=layout.tp,
            pp=layout.pp,
            pp_rank=pp_rank,
            num_microbatches=m,
            schedule=layout.schedule,
            precision=precision,
            device=device,
        )
        for dp_rank in dp_ranks or [0]:
            state = model_state_bytes(
                cfg,
                tp=layout.tp,
                pp=layout.pp,
                dp=layout.dp,
                pp_rank=pp_rank,
                dp_rank=dp_rank,
                rung=layout.rung,
                precision=precision,
                bucket_size=bucket_size,
                grads_in_fp32=grads_in_fp32,
            )
            out.append(RankMemory(pp_rank, dp_rank, state, acts))
    return out


def predict_for_config(
    cfg, *, dp: int, dp_ranks: list[int] | None = None, device: str = "cuda"
) -> list[RankMemory]:
    """``predict_memory`` for a ``PretrainConfig`` on a mesh of data-parallel size ``dp``."""
    par = cfg.parallel
    return predict_memory(
        cfg.model,
        layout_of(cfg, dp=dp),
        global_batch_size=cfg.training.global_batch_size,
        precision=cfg.optimizer.precision_name,
        bucket_size=par.bucket_size(dp),
        grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        dp_ranks=dp_ranks,
        device=device,
    )
