"""The parallel layout of a run (``PretrainConfig.parallel``): the mesh's sizes and rank order, the
pipeline schedule and its virtual stages, the data-parallel rung (DDP, ZeRO-1/2/3) with its grad
buckets and optimizer offload, context and expert parallelism, the device. It validates itself
(``validate``); the rules that join it to the model live in ``PretrainConfig.validate``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megalite.core.distributed import STRATEGIES
from megalite.core.mesh_layout import tp_grid_side
from megalite.core.pipeline_parallel.generators import SCHEDULES
from megalite.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    # how a layer is split inside the tensor group: 1d (Megatron's), 2d (q x q grid), 2.5d
    # (tensor_parallel_depth x q x q), 3d (q x q x q); the group's size stays the device count
    tensor_parallel_mode: str = "1d"
    tensor_parallel_depth: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"  # one of core.pipeline_parallel.generators.SCHEDULES
    # virtual pipeline stages (several model chunks per rank; Megatron's flags) and p2p overlap
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    microbatch_group_size_per_virtual_pipeline_stage: int | None = None  # None: pp
    no_overlap_p2p_communication: bool = False
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None  # elements; None: max(40M, 1M x dp)
    ddp_num_buckets: int | None = None  # Megatron's: bucket size = the rank's parameters // N
    # the grad buffers' dtype: fp32 under bf16 unless grad_reduce_in_bf16 (Megatron's rule,
    # applied by PretrainConfig.validate); fp16 and fp32 params keep their dtype unless set
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1: all-gather a bucket before its first use
    distributed_timeout_minutes: float = 10.0
    # the op recorder and the hang watchdog (training/hang_watch.py): --hang-watchdog, or on when
    # --distributed-timeout-minutes is given
    hang_watchdog: bool = False
    device: str = "auto"  # auto | cpu | cuda
    world_size: int | None = None  # the launcher's, when parsed from flags; None: built in code
    use_tp_pp_dp_mapping: bool = False  # rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp
    # context parallel: the sequence split over cp ranks (shards no parameter); the attention's
    # communication is the model's cp_comm_type
    context_parallel_size: int = 1
    # the sharded data-parallel rungs (ZeRO-1/2/3) and optimizer offload (validate_zero)
    data_parallel_sharding_strategy: str | None = None  # no_shard|optim|optim_grads|..._params
    zero_stage: int | None = None  # DeepSpeed's alias: 0 1 2 3
    optimizer_cpu_offload: bool = False  # optimizer state and step on the host
    optimizer_offload_fraction: float = 1.0  # share of the optimizer state offloaded
    optimizer_offload_dir: str | None = None  # NVMe: the offloaded state in files there
    optimizer_offload_host_memory_mb: float = 256.0  # host buffer bound of the NVMe stream
    # ZeRO-Infinity: ZeRO-3's parameter shards on the host, or in files (validate_zero)
    param_cpu_offload: bool = False
    param_offload_dir: str | None = None
    param_offload_host_memory_mb: float = 256.0  # host staging bound of the param file stream
    # the expert view of the mesh (etp x ep x edp x pp); ETP None = the TP size
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None

    @property
    def rank_order(self) -> str:
        """The mesh's axis order, fastest first (Megatron's default, or its alternative)."""
        return "tp-cp-ep-pp-dp" if self.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"

    @property
    def tp_split_size(self) -> int:
        """What a layer's heads, ffn and vocabulary are split into: the tensor group's size under
        1d, the grid side q under 2d, 2.5d and 3d (valid after ``validate``)."""
        return tp_grid_side(
            self.tensor_model_parallel_size, self.tensor_parallel_mode, self.tensor_parallel_depth
        )

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

    def resolve_grad_dtype(self, *, bf16: bool) -> None:
        """Megatron's rule for the grad buffers: with bf16 params grads are accumulated and
        reduced over DP in fp32 (sets ``accumulate_allreduce_grads_in_fp32``) unless
        ``grad_reduce_in_bf16`` opts into bf16. Idempotent."""
        if self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32:
            raise ConfigError(
                "grad_reduce_in_bf16 and accumulate_allreduce_grads_in_fp32 contradict each "
                "other; keep one"
            )
        if bf16 and not self.grad_reduce_in_bf16:
            self.accumulate_allreduce_grads_in_fp32 = True

    def grad_dtype_line(self, precision: str) -> str:
        """The start-up line saying in which dtype grads are accumulated and reduced over DP
        (``precision``: the params' bf16, fp16 or fp32)."""
        if self.accumulate_allreduce_grads_in_fp32 and precision == "bf16":
            return (
                "bf16 params: gradients accumulated and reduced over DP in fp32 "
                "(--grad-reduce-in-bf16 for bf16)"
            )
        if self.accumulate_allreduce_grads_in_fp32:
            return f"{precision} params: gradients accumulated and reduced over DP in fp32"
        return f"{precision} params: gradients accumulated and reduced over DP in {precision}"

    def sharding_strategy(self) -> str:
        """The data-parallel rung: ``no_shard`` (DDP), ``optim`` (ZeRO-1), ``optim_grads``
        (ZeRO-2) or ``optim_grads_params`` (ZeRO-3)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        if self.zero_stage is not None:
            return STRATEGIES[self.zero_stage]
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def offload(self) -> bool:
        return self.optimizer_cpu_offload or self.optimizer_offload_dir is not None

    @property
    def param_offload(self) -> bool:
        return self.param_cpu_offload or self.param_offload_dir is not None

    @property
    def grad_offload(self) -> bool:
        """ZeRO-3 with the whole optimizer state offloaded: the reduced grad shards go to the
        host, where the step reads them (no grad shard of the model on the device)."""
        whole = self.offload and self.optimizer_offload_fraction == 1.0
        return whole and self.sharding_strategy() == "optim_grads_params"

    def validate_zero(self) -> None:
        """The rung and offload flags agree (one line each otherwise); sets
        ``use_distributed_optimizer`` for every sharded rung."""
        s, z = self.data_parallel_sharding_strategy, self.zero_stage
        if s is not None and s not in STRATEGIES:
            raise ConfigError(
                f"data_parallel_sharding_strategy must be one of {', '.join(STRATEGIES)}, got {s!r}"
            )
        if z is not None and z not in range(4):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {z}")
        if s is not None and z is not None and STRATEGIES[z] != s:
            raise ConfigError(
                f"zero_stage {z} is data_parallel_sharding_strategy {STRATEGIES[z]}, not "
                f"{s}; pass one of the two"
            )
        chosen = s if s is not None else None if z is None else STRATEGIES[z]
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
        self._validate_param_offload(strategy)
        if strategy != "no_shard":
            self.use_distributed_optimizer = True

    def _validate_param_offload(self, strategy: str) -> None:
        if not self.param_offload:
            return
        if strategy != "optim_grads_params":
            raise ConfigError(
                "param_cpu_offload / param_offload_dir offload ZeRO-3's parameter shards: add "
                f"zero_stage 3 (data_parallel_sharding_strategy optim_grads_params), not {strategy}"
            )
        if self.param_offload_host_memory_mb <= 0:
            raise ConfigError(
                f"param_offload_host_memory_mb must be > 0, got {self.param_offload_host_memory_mb}"
            )
        if self.param_offload_dir is None:
            return
        if not (self.offload and self.optimizer_offload_fraction == 1.0):
            raise ConfigError(
                "param_offload_dir needs the whole optimizer state offloaded (fp32 masters there "
                "are the param files): add optimizer_offload_dir or optimizer_cpu_offload with "
                f"optimizer_offload_fraction 1 (got {self.optimizer_offload_fraction})"
            )
        if not _writable_dir(self.param_offload_dir):
            raise ConfigError(
                f"param_offload_dir {self.param_offload_dir} is not a writable directory (nor can "
                "it be created); give a directory this user can write"
            )

    def bucket_size(self, dp_size: int | None = None, stage_numel: int | None = None) -> int:
        """Elements per grad bucket: ``ddp_bucket_size``, else max(40M, 1M x ``dp_size``)."""
        if self.ddp_num_buckets is not None and stage_numel is not None:
            return max(stage_numel // self.ddp_num_buckets, 1)
        if self.ddp_bucket_size is not None:
            return self.ddp_bucket_size
        dp = dp_size if dp_size is not None else self.data_parallel_size or 1
        return max(40_000_000, 1_000_000 * dp)

    def validate(self) -> None:
        self.validate_zero()
        for name, value in (
            ("tensor_model_parallel_size", self.tensor_model_parallel_size),
            ("pipeline_model_parallel_size", self.pipeline_model_parallel_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        try:  # the tensor group's size against its mode's grid
            tp_grid_side(
                self.tensor_model_parallel_size,
                self.tensor_parallel_mode,
                self.tensor_parallel_depth,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got "
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
        if self.ddp_num_buckets is not None and (  # as Megatron: a count or a size
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
        cp = self.context_parallel_size
        if not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"context_parallel_size must be an integer >= 1, got {cp!r}")
        if self.world_size is not None:
            mp = self.model_parallel_size
            tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
            if self.world_size < 1 or self.world_size % mp:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by tensor_model_parallel_size "
                    f"{tp} x pipeline_model_parallel_size {pp} = {mp}; launch a multiple of {mp} "
                    "processes or change the sizes"
                )
            if self.world_size % (mp * cp):
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by tensor x pipeline "
                    f"model-parallel size {mp} x context_parallel_size {cp} = {mp * cp}; launch a "
                    f"multiple of {mp * cp} processes or change the sizes"
                )


def _writable_dir(path: str) -> bool:
    """``path`` is a writable directory, or can be created (its nearest existing parent is)."""
    while not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if parent == os.path.abspath(path):
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
