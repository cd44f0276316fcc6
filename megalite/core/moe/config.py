"""MoEConfig: the plain values a mixture-of-experts layer is built from (core never sees flags).

Names are the model config's ``moe_*`` fields (Megatron's names) without the prefix
(``moe_router_topk`` is ``router_topk``); the model builds one from its config. Messages name the
model config's fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    num_experts: int
    hidden_size: int
    ffn_hidden_size: int  # per expert
    router_topk: int = 2
    router_score_function: str = "softmax"
    router_pre_softmax: bool = False
    router_load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    expert_capacity_factor: float | None = None  # None: dropless
    pad_expert_input_to_capacity: bool = False
    token_drop_policy: str = "probs"
    token_dispatcher_type: str = "alltoall"
    grouped_gemm: bool = False
    swiglu: bool = False
    openai_gelu: bool = False
    init_method_std: float = 0.02
    output_init_std: float = 0.02  # the scaled init of the experts' second linear
    params_dtype: torch.dtype = torch.float32

    def validate(self, *, ep_size: int = 1, etp_size: int = 1) -> None:
        """One-line ValueError naming the field(s), the numbers and the fix."""
        for name, value, allowed in (
            ("moe_router_score_function", self.router_score_function, SCORE_FUNCTIONS),
            (
                "moe_router_load_balancing_type",
                self.router_load_balancing_type,
                LOAD_BALANCING_TYPES,
            ),
            ("moe_token_drop_policy", self.token_drop_policy, DROP_POLICIES),
            ("moe_token_dispatcher_type", self.token_dispatcher_type, DISPATCHERS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.router_topk <= self.num_experts:
            raise ValueError(
                f"moe_router_topk {self.router_topk} must be in [1, num_experts {self.num_experts}]"
            )
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts {self.num_experts} is not divisible by expert_model_parallel_size "
                f"{ep_size}; each EP rank must hold the same number of experts"
            )
        if self.ffn_hidden_size % etp_size:
            raise ValueError(
                f"moe_ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                f"expert_tensor_parallel_size {etp_size}; choose an ETP size that divides it"
            )
        for name, value in (
            ("moe_aux_loss_coeff", self.aux_loss_coeff),
            ("moe_z_loss_coeff", self.z_loss_coeff),
            ("moe_router_bias_update_rate", self.router_bias_update_rate),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            raise ValueError(
                "moe_router_enable_expert_bias needs moe_router_score_function sigmoid "
                f"(got {self.router_score_function}); set it, or drop the expert bias"
            )
        if self.router_pre_softmax and self.router_score_function != "softmax":
            raise ValueError("moe_router_pre_softmax applies to score function softmax only")
        cf = self.expert_capacity_factor
        if cf is not None and cf <= 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0, got {cf}")
        if self.pad_expert_input_to_capacity and cf is None:
            raise ValueError(
                "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (padding to a "
                "capacity); set a capacity factor or drop the padding"
            )
        if self.pad_expert_input_to_capacity and self.token_dispatcher_type != "alltoall":
            raise ValueError(
                "moe_pad_expert_input_to_capacity needs moe_token_dispatcher_type alltoall (got "
                f"{self.token_dispatcher_type}); switch the dispatcher or drop the padding"
            )
        if self.aux_loss_coeff > 0 and self.router_load_balancing_type == "none":
            raise ValueError(
                f"moe_aux_loss_coeff {self.aux_loss_coeff} with load balancing type none; set "
                "moe_router_load_balancing_type aux_loss, seq_aux_loss or global_aux_loss, or the "
                "coefficient to 0"
            )
