"""GPTConfig: the model's shape and options, named after Megatron-LM's flags (``--num-layers`` is
``num_layers``), validated once against the parallel layout.

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

from megalite.core.pipeline_parallel.stages import stage_layer_ranges
from megalite.core.tensor_parallel.layers import padded_vocab_size

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTENTION_BACKENDS = ("sdpa", "unfused")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class GPTConfig:
    """Field names are Megatron's flag names with ``_``. ``None`` sizes are resolved on
    construction: ``max_position_embeddings`` = ``seq_length``, ``ffn_hidden_size`` = 4h (also
    under SwiGLU: pass it explicitly as Megatron users do), ``num_query_groups`` = heads,
    ``kv_channels`` = h / heads, ``recompute_num_layers`` = 1 under full recompute."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # real, unpadded
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
    decoder_first_pipeline_num_layers: int | None = None  # uneven pipeline: first stage's layers
    decoder_last_pipeline_num_layers: int | None = None  # uneven pipeline: last stage's layers
    sequence_parallel: bool = False
    use_fused_kernels: bool = True
    label_smoothing: float = 0.0
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--vocab-size", self.vocab_size),
            ("--seq-length", self.seq_length),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                    f"{self.num_attention_heads}; change one, or set --kv-channels (the head dim)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.recompute_granularity == "full" and self.recompute_num_layers is None:
            self.recompute_num_layers = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to ``make_vocab_size_divisible_by * tp_size``."""
        return padded_vocab_size(
            self.vocab_size,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            tp_size=tp_size,
        )

    def stage_layer_ranges(self, pp_size: int) -> list[tuple[int, int]]:
        """Global ``[start, end)`` layers of every pipeline stage (even, or uneven with the
        ``decoder_first/last_pipeline_num_layers`` counts). On one stage the counts do not apply
        (a model trained unevenly, loaded into one process)."""
        if pp_size == 1:
            return [(0, self.num_layers)]
        return stage_layer_ranges(
            self.num_layers,
            pp_size,
            first_stage_layers=self.decoder_first_pipeline_num_layers,
            last_stage_layers=self.decoder_last_pipeline_num_layers,
        )

    def validate(self, *, tp_size: int = 1, pp_size: int = 1) -> None:
        """Raise a one-line ValueError naming the flag(s), the numbers and the fix for any option or
        size that this layout cannot run. Call before building process groups."""
        _check_choices(self)
        _check_sizes(self)
        _check_parallel(self, tp_size=tp_size, pp_size=pp_size)
        _check_recompute(self)


def _check_choices(c: GPTConfig) -> None:
    for flag, value, allowed in (
        ("--position-embedding-type", c.position_embedding_type, POSITION_EMBEDDING_TYPES),
        ("--normalization", c.normalization, NORMALIZATIONS),
        ("--attention-backend", c.attention_backend, ATTENTION_BACKENDS),
    ):
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {', '.join(allowed)}; got {value!r}")
    for flag, value in (
        ("--hidden-dropout", c.hidden_dropout),
        ("--attention-dropout", c.attention_dropout),
        ("--label-smoothing", c.label_smoothing),
    ):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")
    if c.init_method_std <= 0:
        raise ValueError(f"--init-method-std must be > 0, got {c.init_method_std}")
    if c.norm_epsilon <= 0:
        raise ValueError(f"--norm-epsilon must be > 0, got {c.norm_epsilon}")
    if c.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by must be >= 1, got {c.make_vocab_size_divisible_by}"
        )


def _check_sizes(c: GPTConfig) -> None:
    for flag, value in (
        ("--max-position-embeddings", c.max_position_embeddings),
        ("--ffn-hidden-size", c.ffn_hidden_size),
        ("--num-query-groups", c.num_query_groups),
        ("--kv-channels", c.kv_channels),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    if c.num_attention_heads % c.num_query_groups:
        raise ValueError(
            f"--num-attention-heads {c.num_attention_heads} is not divisible by "
            f"--num-query-groups {c.num_query_groups}; each query group must hold whole heads"
        )
    if c.position_embedding_type == "learned_absolute" and c.seq_length > c.max_position_embeddings:
        raise ValueError(
            f"--seq-length {c.seq_length} exceeds --max-position-embeddings "
            f"{c.max_position_embeddings}; raise --max-position-embeddings or shorten the sequence"
        )
    if c.position_embedding_type == "rope":
        if c.kv_channels % 2:
            raise ValueError(
                f"rotary embeddings need an even head dim (--kv-channels), got {c.kv_channels}"
            )
        if c.rotary_base <= 0:
            raise ValueError(f"--rotary-base must be > 0, got {c.rotary_base}")


def _check_parallel(c: GPTConfig, *, tp_size: int, pp_size: int) -> None:
    tp = f"--tensor-model-parallel-size {tp_size}"
    for flag, value in (
        ("--num-attention-heads", c.num_attention_heads),
        ("--num-query-groups", c.num_query_groups),
        ("--ffn-hidden-size", c.ffn_hidden_size),
    ):
        if value % tp_size:
            raise ValueError(
                f"{flag} {value} is not divisible by {tp}; each TP rank must hold an equal share "
                f"(choose a TP size that divides {value})"
            )
    if c.sequence_parallel and c.seq_length % tp_size:
        raise ValueError(
            f"--seq-length {c.seq_length} is not divisible by {tp} under --sequence-parallel; "
            f"use a multiple of {tp_size}"
        )
    c.stage_layer_ranges(pp_size)  # every stage gets a whole, positive number of layers


def _check_recompute(c: GPTConfig) -> None:
    g, m = c.recompute_granularity, c.recompute_method
    if g is not None and g not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"--recompute-granularity must be full or selective, got {g!r}")
    if m is not None and m not in RECOMPUTE_METHODS:
        raise ValueError(f"--recompute-method must be uniform or block, got {m!r}")
    if g == "full" and m is None:
        raise ValueError(
            "--recompute-granularity full needs --recompute-method uniform or block "
            "(and --recompute-num-layers N)"
        )
    if g != "full" and m is not None:
        raise ValueError(
            f"--recompute-method {m} applies only to --recompute-granularity full "
            f"(got granularity {g!r}); drop --recompute-method"
        )
    if g == "full" and (not isinstance(c.recompute_num_layers, int) or c.recompute_num_layers < 1):
        raise ValueError(f"--recompute-num-layers must be >= 1, got {c.recompute_num_layers!r}")
