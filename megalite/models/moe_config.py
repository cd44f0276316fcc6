"""The MoE fields of ``GPTConfig``: which layers are MoE, the core ``MoEConfig``, and their checks
(``GPTConfig.validate`` calls ``check_moe``)."""

from __future__ import annotations

import ast

from megalite.core.moe.config import MoEConfig


def _eval_pattern(node: ast.AST) -> list | int:
    """A list expression of Megatron's ``--moe-layer-freq`` (``[1,0,1]``, ``([0]+[1]*3)``)."""
    if isinstance(node, ast.Expression):
        return _eval_pattern(node.body)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_pattern(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list expression")


def moe_layer_pattern(config) -> list[bool]:
    """One flag per global layer: MoE or dense. ``moe_layer_freq`` N: layers 0, N, 2N, ... are
    MoE; a list (or its text, e.g. ``"([0]+[1]*3)"``): 1 = MoE, one entry per layer."""
    n, freq = config.num_layers, config.moe_layer_freq
    if config.num_experts is None:
        return [False] * n
    if isinstance(freq, str):
        try:
            freq = _eval_pattern(ast.parse(freq.strip(), mode="eval"))
        except (SyntaxError, ValueError):
            raise ValueError(
                f"moe_layer_freq {config.moe_layer_freq!r} is neither an integer nor a list "
                "like [1,0,1,0] or ([0]+[1]*3)"
            ) from None
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
        return [i % freq == 0 for i in range(n)]
    if len(freq) != n or any(v not in (0, 1) for v in freq):
        raise ValueError(
            f"moe_layer_freq has {len(freq)} entries, need num_layers {n} entries of 0 or 1"
        )
    return [bool(v) for v in freq]


def moe_config(config) -> MoEConfig:
    """The core MoE layer's config from a ``GPTConfig`` with ``num_experts`` set."""
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    return MoEConfig(
        num_experts=config.num_experts,
        hidden_size=config.hidden_size,
        ffn_hidden_size=ffn,
        router_topk=config.moe_router_topk,
        router_score_function=config.moe_router_score_function,
        router_pre_softmax=config.moe_router_pre_softmax,
        router_load_balancing_type=config.moe_router_load_balancing_type,
        aux_loss_coeff=config.moe_aux_loss_coeff,
        z_loss_coeff=config.moe_z_loss_coeff or 0.0,
        router_enable_expert_bias=config.moe_router_enable_expert_bias,
        router_bias_update_rate=config.moe_router_bias_update_rate,
        expert_capacity_factor=config.moe_expert_capacity_factor,
        pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
        token_drop_policy=config.moe_token_drop_policy,
        token_dispatcher_type=config.moe_token_dispatcher_type,
        grouped_gemm=config.moe_grouped_gemm,
        swiglu=config.swiglu,
        openai_gelu=config.openai_gelu,
        init_method_std=config.init_method_std,
        params_dtype=config.params_dtype,
    )


def check_moe(config, *, tp_size: int = 1) -> None:
    """One-line ValueError for MoE options that cannot run (EP/ETP: ``check_moe_parallel``)."""
    moe_options = (
        config.moe_expert_capacity_factor is not None
        or config.moe_shared_expert_intermediate_size is not None
        or config.moe_router_enable_expert_bias
        or config.moe_aux_loss_coeff > 0
    )
    if config.num_experts is None:
        if moe_options:
            raise ValueError("MoE options (moe_*) need num_experts; set it or drop them")
        return
    moe_layer_pattern(config)
    moe_config(config).validate()
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % tp_size):
        raise ValueError(
            f"moe_shared_expert_intermediate_size {shared} must be >= 1 and divisible by "
            f"tp_size {tp_size}"
        )
    if config.moe_shared_expert_gate and shared is None:
        raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
    if config.seq_length % tp_size:  # the MoE layer splits the tokens over TP by position
        raise ValueError(
            f"MoE layers need seq_length {config.seq_length} divisible by tp_size {tp_size}"
        )


def check_moe_parallel(config, *, ep_size: int, etp_size: int) -> None:
    """The expert-parallel sizes against the MoE fields (one line, the numbers, the fix)."""
    if config.num_experts is None:
        if ep_size > 1:
            raise ValueError(
                f"expert_model_parallel_size {ep_size} needs num_experts (an MoE model)"
            )
        return
    moe_config(config).validate(ep_size=ep_size, etp_size=etp_size)
