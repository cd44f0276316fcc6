"""Input embedding of the first pipeline stage: vocab-parallel word embeddings, learned absolute
positions (GPT-2; none under RoPE), then dropout.

Tokens ``[b, s]`` become hidden states ``[s, b, h]``. Under sequence parallel the word embedding is
reduce-scattered straight to this rank's sequence shard ``[s/tp, b, h]`` and only that shard's
positions are added; the position table then sees a shard of the sequence, so it is marked
``sequence_parallel`` (its grad is all-reduced over TP, like the norms').

Under a grid tensor-parallel mode (2d, 2.5d) tokens are this rank's batch block ``[b/(dq), s]``
and the output ``[s, b/(dq), h/q]``: the word table is the mode's embedding, the position table
keeps its hidden block and enters through ``mode.replicated`` (its grad summed over the copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.common import tp_rng_region, weight_init
from megalite.models.config import GPTConfig


class Embedding(nn.Module):
    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        rng_tracker: RNGStatesTracker | None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank
        self.rng_tracker = rng_tracker
        self.mode = mode = tensor_parallel_mode(ps)
        self.word_embeddings = mode.embedding(
            config.vocab_size,
            config.hidden_size,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            reduce_scatter_embeddings=config.sequence_parallel,
            init_method=weight_init(config, "embedding.word_embeddings.weight"),
            params_dtype=config.params_dtype,
            device=device,
        )
        if config.position_embedding_type == "learned_absolute":
            table = torch.empty(config.max_position_embeddings, config.hidden_size)
            weight_init(config, "embedding.position_embeddings.weight")(table)
            table = mode.hidden_block(table)  # [max_pos, h] ([max_pos, h/q] on a grid)
            self.position_embeddings = nn.Embedding.from_pretrained(
                table.to(device=device, dtype=config.params_dtype), freeze=False
            )
            w = self.position_embeddings.weight
            w.sequence_parallel = config.sequence_parallel
            w.tensor_model_parallel, w.partition_dim = False, None
            mode.mark_hidden_block(w)
        else:
            self.position_embeddings = None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens, position_ids: # [b, s] -> # [s, b, h] ([s/tp, b, h] under sequence parallel)."""
        x = self.word_embeddings(tokens.t())  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            # [s, b] (x's batch: under 3d a block of the whole ids' b)
            positions = position_ids.t().expand(tokens.shape[1], x.shape[1])
            if self.sequence_parallel and self.tp_size > 1:
                positions = positions.chunk(self.tp_size, dim=0)[self.tp_rank]
            table = self.mode.replicated(self.position_embeddings.weight)
            x = x + F.embedding(positions, table)
        # each SP rank holds a different shard: draw its mask from the TP stream
        active = self.sequence_parallel and self.training and self.embedding_dropout.p > 0
        with tp_rng_region(self.rng_tracker, active):
            return self.embedding_dropout(x)
