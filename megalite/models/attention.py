"""Causal self-attention with heads and query groups split over tensor parallelism.

The fused QKV projection is one ColumnParallelLinear whose output rows are laid out per query group:
for each of the G groups ``[q_1 .. q_k, k, v]`` (k = heads / G query heads, each ``head_dim`` rows),
groups concatenated. A column split therefore gives TP rank r the whole groups
``[r * G/tp, (r+1) * G/tp)`` and their query heads, so attention needs no communication; the output
projection (RowParallelLinear) sums the ranks' partial products.

Under context parallelism (cp > 1) the input holds this cp rank's two chunks of the sequence
(``core.context_parallel.chunking``) and the core attention runs over the whole sequence with the
configured ``cp_comm_type``: ``p2p`` (ring) and ``all_gather`` compute the attention themselves
(the backend choice does not apply), ``a2a`` trades the sequence split for a head split around the
ordinary ``CoreAttention`` (heads / tp / cp per rank), so every backend and selective recompute
apply to it.

A layer with a window or a sparse layout (``attention_mask.layer_mask_spec``) runs
``core.attention.block_sparse``: only the blocks its mask keeps are computed, documents
(``attention_mask``) included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core import fusions
from megalite.core.attention.block_sparse import block_sparse_attention
from megalite.core.attention.flex_sparse import flex_plan_attention, flex_serves
from megalite.core.attention.masks import BlockPlan, MaskSpec
from megalite.core.context_parallel import (
    CommStats,
    context_parallel_attention,
)
from megalite.core.context_parallel.sparse_ring import sparse_ring_attention
from megalite.core.norms import build_norm
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.core.tensor_parallel.random import RNGStatesTracker, checkpoint
from megalite.models.attention_mask import layer_mask_spec
from megalite.models.common import tp_rng_region, weight_init
from megalite.models.config import GPTConfig
from megalite.models.plan_cache import PlanCache
from megalite.models.rotary import apply_rotary


def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """bool # [s, s], True above the diagonal (key after query): what causal attention hides."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


class CoreAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + causal mask) v``, with dropout on the probabilities.

    q, k, v: # [b, n/tp, s, d] (k and v already expanded from query groups to heads); returns the
    context # [b, n/tp, s, d]. ``sdpa``: torch's scaled_dot_product_attention. ``unfused``: explicit
    scores, then ``fusions.scale_mask_softmax`` (the fused kernel or its reference), dropout, and
    the product with v. Dropout draws from the tracker's tensor-parallel state (heads are sharded).
    """

    def __init__(self, config: GPTConfig, *, rng_tracker: RNGStatesTracker | None):
        super().__init__()
        self.backend = config.attention_backend
        self.scale = config.kv_channels**-0.5
        self.use_fused = config.use_fused_kernels
        self.rng_tracker = rng_tracker
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` (documents reset within a sequence): bool # [b, 1, s, s], True
        where a query may NOT read a key (Megatron's convention), applied on top of the causal
        mask; None: causal only."""
        p = self.attention_dropout.p if self.training else 0.0
        if self.backend == "sdpa":
            with tp_rng_region(self.rng_tracker, p > 0):
                if attention_mask is not None:  # sdpa's bool mask is True where allowed
                    allowed = ~(attention_mask | causal_mask(q.shape[2], q.device))
                    return F.scaled_dot_product_attention(
                        q, k, v, attn_mask=allowed, dropout_p=p, scale=self.scale
                    )
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p, is_causal=True, scale=self.scale
                )
        b, n, s, d = q.shape
        # the scale is applied inside the GEMM (fp32 accumulate), so fp16 scores do not overflow
        scores = torch.baddbmm(
            torch.empty(b * n, s, s, dtype=q.dtype, device=q.device),
            q.reshape(b * n, s, d),
            k.reshape(b * n, s, d).transpose(1, 2),
            beta=0.0,
            alpha=self.scale,
        ).view(b, n, s, s)
        probs = fusions.scale_mask_softmax(
            scores, scale=1.0, causal=True, mask=attention_mask, use_fused=self.use_fused
        )
        with tp_rng_region(self.rng_tracker, p > 0):
            probs = self.attention_dropout(probs)
        return torch.matmul(probs, v)


def _head_norm(
    config: GPTConfig, *, replicated_over_tp: bool, device: torch.device | None
) -> nn.Module:
    """A ``qk_layernorm`` norm over one head's d channels. Replicated over TP but fed different
    heads on each TP rank, so it is marked sequence-parallel (grad summed over TP) when tp > 1."""
    return build_norm(
        config.normalization,
        config.kv_channels,
        eps=config.norm_epsilon,
        sequence_parallel=replicated_over_tp,
        use_fused=config.use_fused_kernels,
        params_dtype=config.params_dtype,
        device=device,
        zero_centered_gamma=config.apply_layernorm_1p,
    )


class SelfAttention(nn.Module):
    """Input # [s, b, h] ([s/tp, b, h] under sequence parallel); output the same shape.

    ``layer_number`` is the GLOBAL 0-based layer index (it names the init keys).
    """

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
        prefix = f"decoder.layers.{layer_number}.self_attention"
        d, n, g = config.kv_channels, config.num_attention_heads, config.num_query_groups
        self.head_dim, self.heads_per_group = d, n // g
        mode = tensor_parallel_mode(ps)  # its linears; groups split over its split_size
        self.local_groups = g // mode.split_size
        self.selective_recompute = config.recompute_granularity == "selective"
        self.rng_tracker = rng_tracker
        self.cp_group, self.cp_size, self.cp_rank = ps.cp_group, ps.cp_size, ps.cp_rank
        self.cp_comm_type = config.cp_comm_type
        self.cp_stats: CommStats | None = None  # set to count the cp traffic (benchmarks, tests)
        self.mask_spec = layer_mask_spec(config, layer_number)  # None: causal (or documents) only
        self.attention_block_size = config.attention_block_size
        # block plans, shared with the chunk's other layers (``TransformerBlock``)
        self.plan_cache = plan_cache if plan_cache is not None else PlanCache()
        common = dict(
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
        )
        qkv_bias = config.add_bias_linear or config.add_qkv_bias  # add_qkv_bias: Qwen2's
        self.linear_qkv = mode.column_linear(
            config.hidden_size,
            (n + 2 * g) * d,
            init_method=weight_init(config, f"{prefix}.linear_qkv.weight"),
            **{**common, "bias": qkv_bias},
        )
        self.core_attention = CoreAttention(config, rng_tracker=rng_tracker)
        self.rotary_interleaved = config.rotary_interleaved
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:  # one norm over each head's d channels for queries, one for keys
            self.q_layernorm = _head_norm(config, replicated_over_tp=ps.tp_size > 1, device=device)
            self.k_layernorm = _head_norm(config, replicated_over_tp=ps.tp_size > 1, device=device)
        self.linear_proj = mode.row_linear(
            n * d,
            config.hidden_size,
            init_method=weight_init(config, f"{prefix}.linear_proj.weight", scaled=True),
            **common,
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv, _ = self.linear_qkv(x)  # [s, b, G/tp * (k + 2) * d]
        s, b = qkv.shape[:2]
        k, d, groups = self.heads_per_group, self.head_dim, self.local_groups
        qkv = qkv.view(s, b, groups, k + 2, d)
        query = qkv[:, :, :, :k].reshape(s, b, groups * k, d)  # [s, b, n/tp, d]
        key, value = qkv[:, :, :, k], qkv[:, :, :, k + 1]  # [s, b, G/tp, d]
        if self.q_layernorm is not None:  # before RoPE, as Megatron
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary is not None:
            query = apply_rotary(query, *rotary, self.rotary_interleaved)
            key = apply_rotary(key, *rotary, self.rotary_interleaved)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, ., s, d]
        if self.cp_size > 1:  # s is this cp rank's s/cp tokens
            if attention_mask is not None or self.mask_spec is not None:
                context = self._context_parallel_masked(query, key, value, attention_mask)
            else:
                context = self._context_parallel(query, key, value)  # [b, n/tp, s/cp, d]
            context = context.permute(2, 0, 1, 3).reshape(s, b, groups * k * d)
            out, _ = self.linear_proj(context)
            return out
        if k > 1:  # query head j of a group reads the group's key/value: heads j*k .. j*k+k-1
            key, value = key.repeat_interleave(k, dim=1), value.repeat_interleave(k, dim=1)
        recompute = self._recompute()
        if self.mask_spec is not None:
            sparse = self._block_sparse(self._plans(attention_mask, s, x.device))
            context = self._run_core(sparse, query, key, value)  # [b, n/tp, s, d]
        elif recompute:
            context = checkpoint(
                self.core_attention,
                query,
                key,
                value,
                attention_mask,
                tracker=self.rng_tracker,
                device=x.device,
            )
        else:
            context = self.core_attention(query, key, value, attention_mask)  # [b, n/tp, s, d]
        context = context.permute(2, 0, 1, 3).reshape(s, b, groups * k * d)  # [s, b, n/tp * d]
        out, _ = self.linear_proj(context)  # [s(/tp), b, h]
        return out

    def _plans(
        self,
        attention_mask: torch.Tensor | None,
        s: int,
        device: torch.device,
        cp: tuple[int, int, int] | None = None,
    ) -> list[BlockPlan]:
        """The block plans of this layer's mask (causal when it has none: documents alone) over
        a sequence of ``s`` tokens (``cp``: (cp size, query rank, key rank) of the ring);
        documents from ``attention_mask``. From the chunk's ``PlanCache``."""
        return self.plan_cache.plans(
            self.mask_spec or MaskSpec(),
            attention_mask,
            block_size=self.attention_block_size,
            seq_length=s,
            device=device,
            cp=cp,
        )

    def _recompute(self) -> bool:
        """Selective recompute of the core attention applies now (training, grads enabled)."""
        return self.selective_recompute and self.training and torch.is_grad_enabled()

    def _run_core(self, core, q, k, v) -> torch.Tensor:
        """``core(q, k, v)``, recomputed in backward under selective recompute."""
        if self._recompute():
            return checkpoint(core, q, k, v, tracker=self.rng_tracker, device=q.device)
        return core(q, k, v)

    def _block_sparse(self, plans: list[BlockPlan]):
        """Block-sparse attention under ``plans`` as a core: (q, k, v) -> context."""
        scale = self.core_attention.scale

        def sparse(q, k, v):
            if flex_serves(q, plans):  # CUDA: the fused kernel on the same blocks
                return flex_plan_attention(q, k, v, plans, scale=scale)
            return block_sparse_attention(q, k, v, plans, scale=scale)

        return sparse

    def _all_to_all(self, query, key, value, core) -> torch.Tensor:
        """a2a context parallelism around ``core`` (# [b, n/tp/cp, s, d], natural order, k/v
        expanded), recomputed under selective recompute."""
        return context_parallel_attention(
            query,
            key,
            value,
            cp_group=self.cp_group,
            comm_type="a2a",
            scale=self.core_attention.scale,
            core_attention=lambda q, k, v: self._run_core(core, q, k, v),
            stats=self.cp_stats,
        )

    def _context_parallel_masked(self, query, key, value, attention_mask) -> torch.Tensor:
        """``_context_parallel`` under a window, a sparse layout or documents (p2p: the sparse
        ring; a2a: block-sparse attention over the gathered sequence)."""
        s = query.shape[2] * self.cp_size
        scale = self.core_attention.scale
        if self.cp_comm_type == "a2a":
            sparse = self._block_sparse(self._plans(attention_mask, s, query.device))
            return self._all_to_all(query, key, value, sparse)
        if self.cp_comm_type != "p2p":
            raise ValueError(
                f"cp_comm_type {self.cp_comm_type} has no window, sparse or document mask; use "
                "cp_comm_type p2p or a2a"
            )
        plans = [
            self._plans(attention_mask, s, query.device, cp=(self.cp_size, self.cp_rank, src))
            for src in range(self.cp_size)
        ]
        return sparse_ring_attention(
            query, key, value, plans, cp_group=self.cp_group, scale=scale, stats=self.cp_stats
        )

    def _context_parallel(self, query, key, value) -> torch.Tensor:
        """query # [b, n/tp, s/cp, d]; key, value # [b, G/tp, s/cp, d] (groups not expanded)."""
        core = self.core_attention
        if self.cp_comm_type == "a2a":
            return self._all_to_all(query, key, value, core)
        p = core.attention_dropout.p if self.training else 0.0
        with tp_rng_region(self.rng_tracker, p > 0):  # the dropout seed, from the TP stream
            return context_parallel_attention(
                query,
                key,
                value,
                cp_group=self.cp_group,
                comm_type=self.cp_comm_type,
                scale=core.scale,
                dropout_p=p,
                stats=self.cp_stats,
            )
