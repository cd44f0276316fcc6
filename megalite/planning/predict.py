"""The prediction for one layout of one run: per-rank model state and activations, from a config.

``predict_memory(cfg, layout)`` joins ``model_state`` and ``activations`` for every pipeline rank;
``layout_of(cfg, world_size)`` reads the layout a ``PretrainConfig`` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megalite.core.optimizer.memory_report import ModelStateBytes
from megalite.models.config import GPTConfig
from megalite.planning.activations import StageActivations, stage_activations
from megalite.planning.model_state import ZERO_RUNGS, ParamSpec, model_state_bytes, rank_params
from megalite.planning.moe_activations import BALANCED, Routing
from megalite.planning.tp_split import TPSplit
from megalite.training.config import PretrainConfig
from megalite.training.pipeline_config import effective_schedule, num_model_chunks


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
    recompute: str | None = None  # None | "selective" | "full" | "block<N>" (first N per chunk)
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel (MoE)
    vp: int = 1  # model chunks per pipeline rank (interleaved, zb-h1; the V schedules: 2)
    etp: int | None = None  # expert tensor parallel (None: tp)
    offload_fraction: float = 0.0  # of the sharded optimizer state, off the device
    optimizer_offload: str = "host"  # where that share lives: host | disk (files)
    param_offload: str = "device"  # ZeRO-3's param shards: device | host | disk (files)
    microbatch_group_size: int | None = None  # interleaved: micro-batches per group (None: pp)
    tp_mode: str = "1d"  # the tensor-parallel mode: 1d | 2d | 2.5d | 3d (tp_split.TPSplit)
    tp_depth: int = 1  # 2.5d: the stacked q x q grids
    offload_dir: str | None = None  # files of a "disk" offload: DIR/optimizer, DIR/params (flags)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """The expert data-parallel size: the world of one pipeline rank over etp x ep."""
        return self.tp * self.dp * self.cp // ((self.etp or self.tp) * self.ep)

    @property
    def split(self) -> TPSplit:
        """How the tensor-parallel mode splits the model over the TP group."""
        return TPSplit(self.tp_mode, self.tp, self.tp_depth)

    @property
    def hidden_state_split(self) -> int:
        """What one rank holds of the hidden states a stage sends: ``1/tp`` under sequence
        parallel or a grid / cube mode (their blocks), all of them under plain 1d."""
        return self.tp if self.sequence_parallel or self.tp_mode != "1d" else 1

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp)]
        if self.tp_mode != "1d":
            out += ["--tensor-parallel-mode", self.tp_mode]
        if self.tp_depth != 1:
            out += ["--tensor-parallel-depth", str(self.tp_depth)]
        out += ["--pipeline-model-parallel-size", str(self.pp)]
        out += ["--micro-batch-size", str(self.micro_batch_size)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None and self.etp != self.tp:
            out += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.pp > 1 and self.schedule != "1f1b":
            out += ["--pipeline-schedule", self.schedule]
        if self.vp > 1 and self.schedule in ("interleaved-1f1b", "zb-h1"):
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vp)]
        out += list(ZERO_RUNGS[self.rung].flags)
        if self.rung != "no_shard":  # hide the grad reduce-scatter / param all-gather
            out.append("--overlap-grad-reduce")
            if self.rung != "optim_grads_params":  # ZeRO-3 gathers per unit itself
                out.append("--overlap-param-gather")
        if self.offload_fraction:
            if self.optimizer_offload == "disk":
                out += ["--optimizer-offload-dir", self._files("optimizer")]
            else:
                out += ["--optimizer-cpu-offload"]
            out += ["--optimizer-offload-fraction", str(self.offload_fraction)]
        if self.param_offload == "host":
            out.append("--param-cpu-offload")
        elif self.param_offload == "disk":
            out += ["--param-offload-dir", self._files("params")]
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute:  # full: every layer; "block<N>": the first N layers of each chunk
            full = self.recompute == "full"
            method = "uniform" if full else "block"
            layers = "1" if full else self.recompute.removeprefix("block")
            out += ["--recompute-granularity", "full", "--recompute-method", method]
            out += ["--recompute-num-layers", layers]
        return out

    def name(self) -> str:
        parts = [f"TP{self.tp}" + self.mode_name(), f"PP{self.pp}", f"DP{self.dp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.vp}" if self.vp > 1 else ""))
        if self.rung != "no_shard":
            parts.append(self.rung)
        parts.append(f"mbs{self.micro_batch_size}")
        if self.recompute:
            parts.append(f"rc-{self.recompute}")
        if self.offload_fraction:
            where = "" if self.optimizer_offload == "host" else f"-{self.optimizer_offload}"
            parts.append(f"offload{self.offload_fraction:g}{where}")
        if self.param_offload != "device":
            parts.append(f"params-{self.param_offload}")
        return " ".join(parts)

    def _files(self, what: str) -> str:
        if self.offload_dir is None:
            raise ValueError(
                f"offload to disk needs a directory for the {what} files (tools/plan.py "
                "--offload-dir DIR)"
            )
        return f"{self.offload_dir}/{what}"

    def mode_name(self) -> str:
        """``""`` under 1d, else the mode (and 2.5d's depth): ``-3d``, ``-2.5d-d2``."""
        if self.tp_mode == "1d":
            return ""
        return f"-{self.tp_mode}" + (f"-d{self.tp_depth}" if self.tp_depth != 1 else "")


def layout_of(cfg: PretrainConfig, *, dp: int) -> Layout:
    """The layout a ``PretrainConfig`` runs with on a mesh of data-parallel size ``dp``."""
    par, m = cfg.parallel, cfg.model
    return Layout(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        dp=dp,
        sequence_parallel=m.sequence_parallel,
        rung=par.sharding_strategy(),
        schedule=effective_schedule(cfg),
        micro_batch_size=cfg.training.micro_batch_size,
        recompute=m.recompute_granularity,
        cp=par.context_parallel_size,
        ep=par.expert_model_parallel_size,
        vp=num_model_chunks(cfg),
        etp=par.expert_tensor_parallel_size,
        offload_fraction=par.optimizer_offload_fraction if par.offload else 0.0,
        optimizer_offload="disk" if par.optimizer_offload_dir is not None else "host",
        param_offload=(
            "disk"
            if par.param_offload_dir is not None
            else "host"
            if par.param_cpu_offload
            else "device"
        ),
        microbatch_group_size=par.microbatch_group_size_per_virtual_pipeline_stage,
        tp_mode=par.tensor_parallel_mode,
        tp_depth=par.tensor_parallel_depth,
    )


def layout_params(c: GPTConfig, layout: Layout, pp_rank: int) -> list[ParamSpec]:
    """``model_state.rank_params`` of pipeline rank ``pp_rank`` split as ``layout`` splits the
    model (TP mode, pipeline chunks, experts)."""
    return rank_params(
        c,
        tp=layout.tp,
        pp=layout.pp,
        pp_rank=pp_rank,
        schedule=layout.schedule,
        vp=layout.vp,
        ep=layout.ep,
        etp=layout.etp,
        tp_mode=layout.tp_mode,
        tp_depth=layout.tp_depth,
    )


def layout_activations(
    c: GPTConfig,
    layout: Layout,
    *,
    pp_rank: int,
    num_microbatches: int,
    precision: str,
    device: str,
    ep_rank: int = 0,
    routing: Routing = BALANCED,
) -> StageActivations:
    """``activations.stage_activations`` of pipeline rank ``pp_rank`` under ``layout``."""
    return stage_activations(
        c,
        micro_batch_size=layout.micro_batch_size,
        tp=layout.tp,
        pp=layout.pp,
        pp_rank=pp_rank,
        num_microbatches=num_microbatches,
        schedule=layout.schedule,
        precision=precision,
        device=device,
        vp=layout.vp,
        microbatch_group_size=layout.microbatch_group_size,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.etp,
        ep_rank=ep_rank,
        routing=routing,
        tp_mode=layout.tp_mode,
        tp_depth=layout.tp_depth,
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
        return self.state.total + self.activations.device_peak


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
    edp_rank: int = 0,
    ep_rank: int = 0,
    routing: Routing = BALANCED,
    memo: dict | None = None,
    offload_host_bytes: tuple[int, int] = (256 << 20, 256 << 20),
) -> list[RankMemory]:
    """Every pipeline rank's prediction (on DP ranks ``dp_ranks``, default 0 only, of the dense
    dp x cp group; ``edp_rank`` of the expert DP group, ``ep_rank`` of the expert-parallel one,
    MoE layers routed as ``routing`` assumes): ``cfg`` is the ``GPTConfig`` with the
    layout's model options (sequence parallel, recompute) set. ``memo``: a dict kept across
    calls for one model (the same flags but the layout's), precision, bucket size and device:
    activations do not depend on the ZeRO rung or offload, model state not on the micro-batch
    size or recompute, so layouts differing only there share them. ``offload_host_bytes``: the
    host bounds of the optimizer's and the params' file streams (``--*-offload-host-memory-mb``)."""
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    memo = {} if memo is None else memo
    acts_key = replace(
        layout,
        rung="no_shard",
        offload_fraction=0.0,
        optimizer_offload="host",
        param_offload="device",
        offload_dir=None,
    )
    state_key = replace(layout, micro_batch_size=1, recompute=None)
    out = []
    for pp_rank in range(layout.pp):
        key = ("activations", acts_key, pp_rank, ep_rank, routing)
        if key not in memo:
            memo[key] = layout_activations(
                cfg,
                layout,
                pp_rank=pp_rank,
                num_microbatches=m,
                precision=precision,
                device=device,
                ep_rank=ep_rank,
                routing=routing,
            )
        acts = memo[key]
        for dp_rank in dp_ranks or [0]:
            key = ("state", state_key, pp_rank, dp_rank, edp_rank, offload_host_bytes)
            if key not in memo:
                memo[key] = model_state_bytes(
                    cfg,
                    tp=layout.tp,
                    pp=layout.pp,
                    dp=layout.dp * layout.cp,
                    pp_rank=pp_rank,
                    dp_rank=dp_rank,
                    rung=layout.rung,
                    precision=precision,
                    bucket_size=bucket_size,
                    grads_in_fp32=grads_in_fp32,
                    schedule=layout.schedule,
                    vp=layout.vp,
                    ep=layout.ep,
                    etp=layout.etp,
                    edp=layout.edp,
                    edp_rank=edp_rank,
                    offload_fraction=layout.offload_fraction,
                    optimizer_place=layout.optimizer_offload,
                    optimizer_host_bytes=offload_host_bytes[0],
                    param_place=layout.param_offload,
                    param_host_bytes=offload_host_bytes[1],
                    tp_mode=layout.tp_mode,
                    tp_depth=layout.tp_depth,
                )
            out.append(RankMemory(pp_rank, dp_rank, memo[key], acts))
    return out


def predict_for_config(
    cfg: PretrainConfig,
    *,
    dp: int,
    dp_ranks: list[int] | None = None,
    device: str = "cuda",
    edp_rank: int = 0,
    ep_rank: int = 0,
    routing: Routing = BALANCED,
) -> list[RankMemory]:
    """``predict_memory`` for a ``PretrainConfig`` on a mesh of data-parallel size ``dp`` (the
    ``dp`` axis alone; ``dp_ranks`` index the dense dp x cp group)."""
    par = cfg.parallel
    return predict_memory(
        cfg.model,
        layout_of(cfg, dp=dp),
        global_batch_size=cfg.training.global_batch_size,
        precision=cfg.model.precision_name,
        bucket_size=par.bucket_size(dp),
        edp_rank=edp_rank,
        ep_rank=ep_rank,
        routing=routing,
        grads_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        dp_ranks=dp_ranks,
        device=device,
        offload_host_bytes=(
            int(par.optimizer_offload_host_memory_mb * 2**20),
            int(par.param_offload_host_memory_mb * 2**20),
        ),
    )
