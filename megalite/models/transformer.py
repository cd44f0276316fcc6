"""The pre-norm transformer layer and the block of layers one pipeline stage holds, with activation
recomputation.

Layer (HF GPT-2 / Llama order)::

    x = x + dropout(attention(norm_1(x)))
    x = x + dropout(mlp(norm_2(x)))

Hidden dropout acts on full activations (identical on every TP rank) and draws from the default
generator, which ``model_parallel_seed`` seeds identically across TP ranks; under sequence parallel
each TP rank holds a different shard and draws from the tracker's TP stream instead.

Recompute (``recompute_granularity``, ``recompute_method``):
- ``full``, ``uniform``: the stage's layers in chunks of ``recompute_num_layers``, each chunk's
  activations dropped after forward and recomputed in backward (only chunk inputs are kept).
- ``full``, ``block``: the first ``recompute_num_layers`` layers of the stage, one at a time; the
  rest keep their activations.
- ``selective``: only the core attention (scores, softmax, dropout), the cheap-to-recompute,
  memory-hungry part (see ``attention.SelfAttention``).
All go through ``tensor_parallel.random.checkpoint``, which replays the default and tracker RNG
states, so dropout masks in the recomputation equal the forward's.

Activation offload (``cpu_offloading``, ``cpu_offloading_num_layers`` N, by
``core.activation_offload``): the saved activations of the block's first N layers live on the
host between forward and backward. Under full recompute a recomputed layer saves only its
checkpoint's inputs: those are what move (a uniform chunk moves when its first layer is among the
first N); a layer of ``block`` past ``recompute_num_layers`` keeps its activations, and moves them
when it is among the first N.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.activation_offload import ActivationOffload
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.core.tensor_parallel.random import RNGStatesTracker, checkpoint
from megalite.models.attention import SelfAttention
from megalite.models.common import tp_rng_region
from megalite.models.config import GPTConfig
from megalite.models.moe_layer import build_mlp  # MoE or dense, per layer
from megalite.models.plan_cache import PlanCache


def hidden_norm(config: GPTConfig, ps: ParallelState, device: torch.device | None) -> nn.Module:
    """The hidden-state norm of the tensor-parallel mode (a grid's splits the hidden dim)."""
    return tensor_parallel_mode(ps).norm(
        config.normalization,
        config.hidden_size,
        eps=config.norm_epsilon,
        sequence_parallel=config.sequence_parallel,
        use_fused=config.use_fused_kernels,
        params_dtype=config.params_dtype,
        device=device,
        zero_centered_gamma=config.apply_layernorm_1p,
    )


class TransformerLayer(nn.Module):
    """Input and output # [s, b, h] ([s/tp, b, h] under sequence parallel). ``layer_number`` is the
    GLOBAL 0-based index; ``cos``/``sin`` are the rotary tables (None without RoPE)."""

    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        layer_number: int,
        rng_tracker: RNGStatesTracker | None,
        device: torch.device | None = None,
        plan_cache: PlanCache | None = None,
    ):
        super().__init__()
        self.layer_number = layer_number
        self.sequence_parallel = config.sequence_parallel
        self.rng_tracker = rng_tracker
        self.input_layernorm = hidden_norm(config, ps, device)
        self.self_attention = SelfAttention(
            config,
            ps,
            layer_number=layer_number,
            rng_tracker=rng_tracker,
            device=device,
            plan_cache=plan_cache,
        )
        self.pre_mlp_layernorm = hidden_norm(config, ps, device)
        self.mlp = build_mlp(config, ps, layer_number=layer_number, device=device)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        active = self.sequence_parallel and self.training and self.hidden_dropout.p > 0
        with tp_rng_region(self.rng_tracker, active):
            return residual + self.hidden_dropout(x)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,  # bool [b, 1, s, s], True = hidden
    ) -> torch.Tensor:
        rotary = None if cos is None else (cos, sin)
        attn = self.self_attention(self.input_layernorm(hidden), rotary, attention_mask)
        hidden = self._dropout_add(attn, hidden)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(hidden)), hidden)


class TransformerBlock(nn.Module):
    """The layers ``[start, end)`` (global numbers) of one stage; ``final_layernorm`` on the last
    stage (``post_process``). ``layers[i]`` is global layer ``layer_offset + i``."""

    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        layer_range: tuple[int, int],
        post_process: bool,
        rng_tracker: RNGStatesTracker | None,
        device: torch.device | None = None,
    ):
        super().__init__()
        start, end = layer_range
        self.layer_offset = start
        self.rng_tracker = rng_tracker
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.plan_cache = PlanCache()  # the layers' block plans, built once for all of them
        self.layers = nn.ModuleList(
            TransformerLayer(
                config,
                ps,
                layer_number=number,
                rng_tracker=rng_tracker,
                device=device,
                plan_cache=self.plan_cache,
            )
            for number in range(start, end)
        )
        self.final_layernorm = hidden_norm(config, ps, device) if post_process else None
        self.offload_num_layers = config.cpu_offloading_num_layers if config.cpu_offloading else 0
        if self.offload_num_layers > len(self.layers):
            n = len(self.layers)
            raise ValueError(
                f"cpu_offloading_num_layers {self.offload_num_layers} exceeds the {n} layers "
                f"[{start}, {end}) of this model chunk; use at most {n}"
            )
        self.activation_offload = ActivationOffload() if self.offload_num_layers else None

    def _offloaded(self, i: int, run, *args, **kwargs):
        """``run(*args, **kwargs)``; what it saves for backward is kept on the host when local
        layer ``i`` is among the first ``cpu_offloading_num_layers``."""
        if self.activation_offload is None or i >= self.offload_num_layers:
            return run(*args, **kwargs)
        key = self.layers[i].layer_number
        with self.activation_offload.region(key=key, params=self.layers[i].parameters()):
            return run(*args, **kwargs)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cos, sin = rotary if rotary is not None else (None, None)
        if self.activation_offload is not None:
            self.activation_offload.new_forward()
        if self.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            hidden = self._recomputed_forward(hidden, cos, sin, attention_mask)
        else:
            for i, layer in enumerate(self.layers):
                hidden = self._offloaded(i, layer, hidden, cos, sin, attention_mask)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden

    def _chunk(self, start: int, end: int):
        def run(hidden, cos, sin, attention_mask=None):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, cos, sin, attention_mask)
            return hidden

        return run

    def _recomputed_forward(self, hidden, cos, sin, attention_mask=None) -> torch.Tensor:
        n, per = len(self.layers), self.recompute_num_layers
        where = {"tracker": self.rng_tracker, "device": hidden.device}
        if self.recompute_method == "uniform":
            for start in range(0, n, per):
                run = self._chunk(start, min(start + per, n))
                hidden = self._offloaded(
                    start, checkpoint, run, hidden, cos, sin, attention_mask, **where
                )
            return hidden
        for i, layer in enumerate(self.layers):  # block
            if i < per:
                hidden = self._offloaded(
                    i, checkpoint, layer, hidden, cos, sin, attention_mask, **where
                )
            else:
                hidden = self._offloaded(i, layer, hidden, cos, sin, attention_mask)
        return hidden
