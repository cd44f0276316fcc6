"""GPTConfig: the model's shape and options, validated once against the parallel layout.

Fields are named after Megatron-LM's flags (``--num-layers`` is ``num_layers``); errors name the
fields and the numbers (the flag layer, ``megalite.training.arguments``, shows them as flags).

Two families come out of the same fields:

- GPT-2 (the defaults): learned absolute positions, pre-LayerNorm, GELU MLP of ``4h``, biases,
  input and output embeddings tied.
- Llama: ``position_embedding_type="rope"``, ``normalization="RMSNorm"``, ``swiglu=True``,
  ``num_query_groups`` < heads (GQA), ``add_bias_linear=False``,
  ``untie_embeddings_and_output_weights=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.core.context_parallel import CP_COMM_TYPES
from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.core.tensor_parallel.layers import padded_vocab_size
from megalite.models.attention_mask import check_mask
from megalite.models.moe_config import check_moe

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTENTION_BACKENDS = ("sdpa", "unfused")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
VOCAB_FROM_TOKENIZER = 0  # vocab_size placeholder: set from the tokenizer before validate()
# Megatron's precision flags (--bf16, --fp16; neither: fp32) -> the parameters' dtype
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class GPTConfig:
    """``None`` sizes are resolved on construction: ``max_position_embeddings`` = ``seq_length``,
    ``ffn_hidden_size`` = 4h (also under SwiGLU: pass it explicitly as Megatron users do),
    ``num_query_groups`` = heads, ``kv_channels`` = h / heads, ``recompute_num_layers`` = 1 under
    full recompute. ``vocab_size`` 0 (``VOCAB_FROM_TOKENIZER``) means "not known yet": the
    training config fills it from the tokenizer, and ``validate`` refuses it until then."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # real, unpadded; VOCAB_FROM_TOKENIZER until the tokenizer is built
    seq_length: int
    max_position_embeddings: int | None = None
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximate GELU (HF "gelu_new"); default exact GELU
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    attention_backend: str = "sdpa"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    cpu_offloading: bool = False  # saved activations of the first layers of each chunk on the host
    cpu_offloading_num_layers: int = 0  # how many (Megatron's --cpu-offloading-num-layers)
    decoder_first_pipeline_num_layers: int | None = None  # uneven pipeline: first stage's layers
    decoder_last_pipeline_num_layers: int | None = None  # uneven pipeline: last stage's layers
    sequence_parallel: bool = False
    use_fused_kernels: bool = True
    label_smoothing: float = 0.0
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234  # the weights' initialisation, dropout and the data order
    cp_comm_type: str = "p2p"  # context parallel attention: p2p | a2a | all_gather (cp > 1)
    # mixture of experts (Megatron's --num-experts, --moe-*; models/moe_config.py)
    num_experts: int | None = None  # None: dense MLPs everywhere
    moe_ffn_hidden_size: int | None = None  # per expert; None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_layer_freq: int | str = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    add_qkv_bias: bool = False  # a bias on the QKV projection only (Qwen2, Qwen2-MoE)
    # Megatron's options of the math (models/rotary.py, core/norms.py, models/mlp.py, attention)
    apply_layernorm_1p: bool = False  # norm weights stored as w - 1, applied as 1 + w
    qk_layernorm: bool = False  # a norm over each head's query and key (head dim)
    squared_relu: bool = False  # relu(x)^2 instead of GELU
    rotary_percent: float = 1.0  # RoPE on the first int(kv_channels * percent) channels
    rotary_interleaved: bool = False  # pairs (2i, 2i+1) rotate instead of (i, i + d/2)
    use_rope_scaling: bool = False  # Llama 3.1 frequency scaling (HF rope_type "llama3")
    rope_scaling_factor: float = 8.0
    # windowed and block-sparse attention (models/attention_mask.py, core/attention/)
    window_size: tuple[int, int] | None = None  # (left, right) keys around a query; -1: no bound
    window_attn_skip_freq: int | str | None = None  # N: every N-th layer full; list: 1 = windowed
    sparse_attention: str | None = None  # fixed | bigbird | longformer
    sparse_block_size: int = 16  # positions per layout block
    sparse_num_local_blocks: int = 4  # fixed: the run of local blocks
    sparse_num_global_blocks: int = 1  # fixed: strided blocks per run; bigbird/longformer: global
    sparse_num_window_blocks: int = 3  # bigbird/longformer: sliding window, in blocks
    sparse_num_random_blocks: int = 1  # bigbird: random earlier blocks per row (seeded by seed)
    attention_block_size: int = 64  # tokens per block the block-sparse attention computes

    def __post_init__(self) -> None:
        for name, value in (
            ("num_layers", self.num_layers),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
            ("seq_length", self.seq_length),
        ):
            if name == "vocab_size" and value == VOCAB_FROM_TOKENIZER and type(value) is int:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; change one, or set kv_channels (the head dim)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.recompute_granularity == "full" and self.recompute_num_layers is None:
            self.recompute_num_layers = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def precision_name(self) -> str:
        """``params_dtype`` as Megatron's precision flags name it: bf16, fp16 or fp32."""
        return next(name for name, dtype in PARAMS_DTYPES.items() if dtype == self.params_dtype)

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to ``make_vocab_size_divisible_by * tp_size``."""
        return padded_vocab_size(
            self.vocab_size,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            tp_size=tp_size,
        )

    def stage_layer_ranges(
        self, pp_size: int, *, num_virtual_stages: int = 1
    ) -> list[tuple[int, int]] | list[list[tuple[int, int]]]:
        """Global ``[start, end)`` layers of every pipeline rank (even, or uneven with the
        ``decoder_first/last_pipeline_num_layers`` counts); per rank a list of its chunks' ranges
        when ``num_virtual_stages`` > 1 (``core.pipeline_parallel.stages``). On one stage the
        counts do not apply (a model trained unevenly, loaded into one process)."""
        uneven = pp_size > 1
        return stage_layer_ranges(
            self.num_layers,
            pp_size,
            num_virtual_stages=num_virtual_stages,
            first_stage_layers=self.decoder_first_pipeline_num_layers if uneven else None,
            last_stage_layers=self.decoder_last_pipeline_num_layers if uneven else None,
        )

    def validate(self, *, tp_size: int = 1, pp_size: int = 1) -> None:
        """Raise a one-line ValueError naming the field(s), the numbers and the fix for any option
        or size that this layout cannot run. Call before building process groups."""
        if self.vocab_size == VOCAB_FROM_TOKENIZER:
            raise ValueError(
                "vocab_size is 0 (not known yet); set it from the tokenizer before validating "
                "or building the model"
            )
        _check_choices(self)
        _check_sizes(self)
        _check_parallel(self, tp_size=tp_size, pp_size=pp_size)
        _check_recompute(self)
        _check_offload(self, pp_size=pp_size)
        _check_megatron_math(self)
        check_moe(self, tp_size=tp_size)
        check_mask(self)

    @property
    def block_sparse(self) -> bool:
        """Some layer has a window or a sparse layout (attention by ``core.attention``)."""
        return self.window_size is not None or self.sparse_attention is not None


def _check_choices(c: GPTConfig) -> None:
    for name, value, allowed in (
        ("position_embedding_type", c.position_embedding_type, POSITION_EMBEDDING_TYPES),
        ("normalization", c.normalization, NORMALIZATIONS),
        ("attention_backend", c.attention_backend, ATTENTION_BACKENDS),
        ("cp_comm_type", c.cp_comm_type, CP_COMM_TYPES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    for name, value in (
        ("hidden_dropout", c.hidden_dropout),
        ("attention_dropout", c.attention_dropout),
        ("label_smoothing", c.label_smoothing),
    ):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    if c.init_method_std <= 0:
        raise ValueError(f"init_method_std must be > 0, got {c.init_method_std}")
    if c.norm_epsilon <= 0:
        raise ValueError(f"norm_epsilon must be > 0, got {c.norm_epsilon}")
    if not isinstance(c.seed, int) or c.seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {c.seed!r}")
    if c.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"make_vocab_size_divisible_by must be >= 1, got {c.make_vocab_size_divisible_by}"
        )


def _check_sizes(c: GPTConfig) -> None:
    for name, value in (
        ("max_position_embeddings", c.max_position_embeddings),
        ("ffn_hidden_size", c.ffn_hidden_size),
        ("num_query_groups", c.num_query_groups),
        ("kv_channels", c.kv_channels),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if c.num_attention_heads % c.num_query_groups:
        raise ValueError(
            f"num_attention_heads {c.num_attention_heads} is not divisible by "
            f"num_query_groups {c.num_query_groups}; each query group must hold whole heads"
        )
    if c.position_embedding_type == "learned_absolute" and c.seq_length > c.max_position_embeddings:
        raise ValueError(
            f"seq_length {c.seq_length} exceeds max_position_embeddings "
            f"{c.max_position_embeddings}; raise max_position_embeddings or shorten the sequence"
        )
    if c.position_embedding_type == "rope":
        if c.kv_channels % 2:
            raise ValueError(
                f"rotary embeddings need an even head dim (kv_channels), got {c.kv_channels}"
            )
        if c.rotary_base <= 0:
            raise ValueError(f"rotary_base must be > 0, got {c.rotary_base}")


def _check_parallel(c: GPTConfig, *, tp_size: int, pp_size: int) -> None:
    tp = f"tp_size {tp_size}"
    for name, value in (
        ("num_attention_heads", c.num_attention_heads),
        ("num_query_groups", c.num_query_groups),
        ("ffn_hidden_size", c.ffn_hidden_size),
    ):
        if value % tp_size:
            raise ValueError(
                f"{name} {value} is not divisible by {tp}; each TP rank must hold an equal share "
                f"(choose a TP size that divides {value})"
            )
    if c.sequence_parallel and c.seq_length % tp_size:
        raise ValueError(
            f"seq_length {c.seq_length} is not divisible by {tp} under sequence_parallel; "
            f"use a multiple of {tp_size}"
        )
    c.stage_layer_ranges(pp_size)  # every stage gets a whole, positive number of layers


def _check_recompute(c: GPTConfig) -> None:
    g, m = c.recompute_granularity, c.recompute_method
    if g is not None and g not in RECOMPUTE_GRANULARITIES:
        allowed = " or ".join(RECOMPUTE_GRANULARITIES)
        raise ValueError(f"recompute_granularity must be {allowed}, got {g!r}")
    if m is not None and m not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute_method must be {' or '.join(RECOMPUTE_METHODS)}, got {m!r}")
    if g == "full" and m is None:
        raise ValueError(
            "recompute_granularity full needs recompute_method uniform or block "
            "(and recompute_num_layers N)"
        )
    if g != "full" and m is not None:
        raise ValueError(
            f"recompute_method {m} applies only to recompute_granularity full "
            f"(got granularity {g!r}); drop recompute_method"
        )
    if g == "full" and (not isinstance(c.recompute_num_layers, int) or c.recompute_num_layers < 1):
        raise ValueError(f"recompute_num_layers must be >= 1, got {c.recompute_num_layers!r}")


def _check_offload(c: GPTConfig, *, pp_size: int) -> None:
    """``cpu_offloading_num_layers`` N counts layers of each model chunk: 0 <= N <= the fewest
    layers a pipeline stage holds (virtual chunks are checked when they are built)."""
    n = c.cpu_offloading_num_layers
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"cpu_offloading_num_layers must be an integer >= 0, got {n!r}")
    if not c.cpu_offloading:
        return
    fewest = min(end - start for start, end in c.stage_layer_ranges(pp_size))
    if n > fewest:
        raise ValueError(
            f"cpu_offloading_num_layers {n} exceeds the {fewest} layers of a model chunk "
            f"(num_layers {c.num_layers} over pp_size {pp_size}); use at most {fewest}"
        )


def _check_megatron_math(c: GPTConfig) -> None:
    """Megatron's options of the math: partial and scaled RoPE, the activation choices."""
    if not 0.0 < c.rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent must be in (0, 1], got {c.rotary_percent}")
    if c.position_embedding_type == "rope" and int(c.kv_channels * c.rotary_percent) < 2:
        raise ValueError(
            f"rotary_percent {c.rotary_percent} of kv_channels {c.kv_channels} leaves fewer than "
            "2 rotary channels; raise rotary_percent"
        )
    if c.use_rope_scaling and c.rope_scaling_factor < 1.0:
        raise ValueError(f"rope_scaling_factor must be >= 1, got {c.rope_scaling_factor}")
    if c.squared_relu and c.swiglu:
        raise ValueError("squared_relu and swiglu are two activations; choose one")
    if c.squared_relu and c.num_experts is not None:
        raise ValueError(
            "squared_relu is not implemented in the MoE experts (num_experts); drop one of them"
        )
