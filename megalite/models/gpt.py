"""GPTModel: one pipeline stage of a decoder-only transformer (GPT-2 or Llama style).

A stage holds the embedding (``pre_process``, the first stage), the layers ``layer_range``
(global ``[start, end)``), and the final norm, output layer and loss (``post_process``, the last
stage). With one stage it is the whole model. Activations between stages are ``[s, b, h]``
(``[s/tp, b, h]`` under sequence parallel).

Output layer: a ColumnParallelLinear over the padded vocabulary, ``[s, b, V_pad/tp]`` logits, whose
weight is the word embedding's when they are tied (the default). On a last stage without the
embedding (pipeline parallel) the tied weight is a copy initialised from the embedding's init key;
``shared_embedding_or_output_weight()`` returns the weight whose grad the training loop all-reduces
over the embedding group to keep the copies equal.

Tensor-parallel modes (``tensor_parallel_mode(ps)``): every layer comes from the mode. Under a grid
(2d, 2.5d) a rank computes its batch block of the micro-batch (``mode.batch_block``) with hidden
states ``[s, b/(dq), h/q]`` between stages, the output layer shares the embedding table's layout,
and the per-token loss is gathered back to the whole micro-batch (``mode.gather_batch``), so the
training loop sees what it sees under 1d.

Vocabulary padding: only the real ``vocab_size`` rows of the word embedding and the output layer are
initialised (padding rows are zero) and the loss masks the padding columns, so any padding (any TP
size) computes the same function as the unpadded model.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.common import weight_init
from megalite.models.config import GPTConfig
from megalite.models.embedding import Embedding
from megalite.models.rotary import local_position_ids, rotary_cos_sin
from megalite.models.transformer import TransformerBlock, TransformerLayer, hidden_norm

WORD_EMBEDDING_KEY = "embedding.word_embeddings.weight"


def _no_init(weight: torch.Tensor) -> None:
    """For the tied output layer's placeholder weight, which is dropped at once."""


class GPTModel(nn.Module):
    """One pipeline stage of the GPT model (the whole model when pre- and post-process).

    ``rng_tracker`` (from ``model_parallel_seed``) is needed only when dropout is on and acts on
    tensor- or sequence-parallel activations; with dropout 0 it may be None.
    """

    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_range: tuple[int, int] | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.mode = tensor_parallel_mode(ps)
        config.validate(tp_size=self.mode.split_size, pp_size=ps.pp_size)
        if layer_range is None:
            layer_range = config.stage_layer_ranges(ps.pp_size)[ps.pp_rank]
        start, end = layer_range
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(
                f"layer_range {layer_range} is not within [0, num_layers {config.num_layers}]"
            )
        self.config, self.tp_group = config, ps.tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = (start, end)
        self.tied = not config.untie_embeddings_and_output_weights
        self.padded_vocab_size = config.padded_vocab_size(self.mode.split_size)
        self.sequence_parallel_factor = ps.tp_size if config.sequence_parallel else 1
        self.input_tensor: torch.Tensor | None = None
        self._embedding_owner: GPTModel | None = None  # see borrow_embedding
        self.cp_size, self.cp_rank = ps.cp_size, ps.cp_rank  # default positions under cp

        self.embedding = (
            Embedding(config, ps, rng_tracker=rng_tracker, device=device) if pre_process else None
        )
        self.decoder = TransformerBlock(
            config,
            ps,
            layer_range=self.layer_range,
            post_process=post_process,
            rng_tracker=rng_tracker,
            device=device,
        )
        self.output_layer = self._build_output_layer(ps, device) if post_process else None

    def _build_output_layer(self, ps: ParallelState, device: torch.device | None) -> nn.Module:
        c = self.config
        borrowed = self.tied and self.pre_process  # uses the word embedding's weight
        key = WORD_EMBEDDING_KEY if self.tied else "output_layer.weight"
        layer = self.mode.output_layer(
            c.vocab_size,
            self.padded_vocab_size,
            c.hidden_size,
            sequence_parallel=c.sequence_parallel,
            make_vocab_size_divisible_by=c.make_vocab_size_divisible_by,
            init_method=_no_init if borrowed else weight_init(c, key),
            params_dtype=c.params_dtype,
            device=device,
        )
        if borrowed:
            layer.weight = None  # forward receives the embedding's weight
        return layer

    def build_twin(self, unit: nn.Module, ps: ParallelState) -> nn.Module:
        """``unit`` (this stage's embedding, one of its layers, its final norm or its output
        layer) built again on the CPU, alone: the values a normal build gives it (the same keyed
        initialisation). For a stage built on the meta device and filled one unit at a time
        (ZeRO-3's ``unit_init``, ``core.distributed.deferred_init``)."""
        c, cpu = self.config, torch.device("cpu")
        if unit is self.embedding:
            return Embedding(c, ps, rng_tracker=None, device=cpu)
        if unit is self.output_layer:
            return self._build_output_layer(ps, cpu)
        if unit is self.decoder.final_layernorm:
            return hidden_norm(c, ps, cpu)
        for layer in self.decoder.layers:
            if unit is layer:
                return TransformerLayer(
                    c, ps, layer_number=layer.layer_number, rng_tracker=None, device=cpu
                )
        raise ValueError(f"{type(unit).__name__} is no unit of this GPT stage")

    def borrow_embedding(self, owner: GPTModel) -> None:
        """Tie this last stage's output layer to ``owner``'s word embedding on the same rank (two
        chunks of a V-shaped pipeline): the output layer uses that Parameter, holds no copy."""
        self.output_layer.weight = None
        self.__dict__["_embedding_owner"] = owner  # not a submodule: its params stay owner's

    def set_input_tensor(self, t: torch.Tensor | None) -> None:
        """Non-first stages: the hidden states received from the previous stage,
        # [s, b, h] ([s/tp, b, h] under sequence parallel)."""
        self.input_tensor = t

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The tied word-embedding / output weight this stage holds (None if untied or neither)."""
        if not self.tied:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight  # None when borrowed from a chunk of this rank
        return None

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, position_ids, labels: # [b, s] int64 (tokens read on the first stage only;
        position_ids None means 0..s-1). ``attention_mask`` (documents reset within a sequence,
        Megatron's reset attention mask): bool # [b, 1, s, s], True where a query may not read a
        key, on top of the causal mask.

        Returns, on the last stage with labels: the per-token loss # [b, s] fp32 (padding vocabulary
        excluded); on the last stage without labels: logits # [b, s, V_pad/tp] (columns at or past
        ``vocab_size`` are padding); on other stages: hidden states # [s, b, h] ([s/tp, b, h] under
        sequence parallel). Under a grid tensor-parallel mode the loss is the whole micro-batch's
        as well, logits and hidden states this rank's blocks # [b/(dq), s, V_pad/q] and
        # [s, b/(dq), h/q]; under 3d # [b/q^2, s, V_pad/q] and # [s, b/q^2, h/q] (``mode3d.py``'s
        layouts: the logits' batch block is not the hidden states').
        """
        mode = self.mode  # under a grid: this rank's batch block of the micro-batch
        tokens = None if tokens is None else mode.batch_block(tokens, 0)
        labels = None if labels is None else mode.batch_block(labels, 0)
        rope_positions = None  # per-sample positions: the blocks the embedding and attention hold
        if position_ids is not None and position_ids.shape[0] > 1:
            position_ids = mode.batch_block(position_ids, 0)
            rope_positions = mode.attention_block(position_ids, 0)
            position_ids = mode.residual_block(position_ids, 0)
        if attention_mask is not None:
            attention_mask = mode.attention_block(mode.batch_block(attention_mask, 0), 0)
        if self.pre_process:
            seq_length, device = tokens.shape[1], tokens.device
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first stage needs set_input_tensor() before forward")
            seq_length = self.input_tensor.shape[0] * self.sequence_parallel_factor
            device = self.input_tensor.device
        if position_ids is None:  # [1, s] (this cp rank's chunks' positions under cp)
            position_ids = local_position_ids(
                seq_length, cp_size=self.cp_size, cp_rank=self.cp_rank, device=device
            )

        if self.pre_process:
            hidden = self.embedding(tokens, position_ids)  # [s(/tp), b, h]
        else:
            hidden = self.input_tensor
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = rotary_cos_sin(
                position_ids if rope_positions is None else rope_positions,
                head_dim=self.config.kv_channels,
                base=self.config.rotary_base,
                dtype=hidden.dtype,
                rotary_percent=self.config.rotary_percent,
                interleaved=self.config.rotary_interleaved,
                rope_scaling_factor=(
                    self.config.rope_scaling_factor if self.config.use_rope_scaling else None
                ),
            )
        hidden = self.decoder(hidden, rotary, attention_mask)
        if not self.post_process:
            return hidden

        weight = None
        if self.output_layer.weight is None:  # tied: the (borrowed) word embedding
            owner = self if self._embedding_owner is None else self._embedding_owner
            weight = owner.embedding.word_embeddings.weight
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = mode.cross_entropy(
            logits,
            labels.t(),
            vocab_size=self.config.vocab_size,
            label_smoothing=self.config.label_smoothing,
        )  # [s, b] fp32 ([s, b/(dq)] on a grid)
        return mode.gather_batch(loss, -1).t().contiguous()
