"""megalite <-> HuggingFace ``MistralForCausalLM``: a Llama with a sliding window.

Mistral's layers, names and RoPE are Llama's (``llama`` maps them); what it adds is
``sliding_window`` W on every layer: query q reads keys k with ``q - W < k <= q``. megalite's
``window_size`` (LEFT, RIGHT) is Megatron's: ``q - LEFT <= k <= q + RIGHT``, ANDed with causality,
so ``W = LEFT + 1`` and RIGHT must be 0 (a window reaching forward is not Mistral's). A LEFT of -1
(no bound) is ``sliding_window`` None: plain causal attention.

What Mistral cannot express is refused: ``window_attn_skip_freq`` (full layers among windowed
ones; MistralConfig has no per-layer ``layer_types``, it windows every layer) and block-sparse
layouts. Importing a Mistral without a ``sliding_window`` gives a plain Llama-family model.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.conversion import llama
from megalite.conversion.errors import ConversionError
from megalite.models.attention_mask import window_layer_pattern
from megalite.models.config import GPTConfig

MODEL = "MistralForCausalLM"


def check(config: GPTConfig) -> None:
    """One-line ConversionError for a model MistralForCausalLM cannot express."""
    llama.check(config, model=MODEL, sliding_window=True)
    if config.window_size is None:
        raise ConversionError(f"{MODEL} needs --window-size; this model has none (it is a Llama)")
    left, right = config.window_size
    if right != 0:
        raise ConversionError(
            f"{MODEL} needs --window-size LEFT,0 (its window ends at the query); got {left},{right}"
        )
    full = [i for i, windowed in enumerate(window_layer_pattern(config)) if not windowed]
    if full:
        raise ConversionError(
            f"{MODEL} windows every layer; --window-attn-skip-freq "
            f"{config.window_attn_skip_freq} leaves layers {full} full"
        )


def sliding_window(config: GPTConfig) -> int | None:
    """HF's ``sliding_window`` of megalite's ``window_size`` (LEFT, 0): LEFT + 1 keys per query,
    itself included; None for an unbounded LEFT (-1)."""
    left = config.window_size[0]
    return None if left < 0 else left + 1


def _llama_view(config: GPTConfig) -> GPTConfig:
    """The Llama config of the same weights (the window changes no tensor)."""
    return dataclasses.replace(config, window_size=None, window_attn_skip_freq=None)


def hf_config(config: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    """The ``transformers.MistralConfig`` of ``config``'s model."""
    import transformers

    check(config)
    return transformers.MistralConfig(
        **llama.config_kwargs(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id),
        head_dim=config.kv_channels,
        rope_theta=float(config.rotary_base),
        rope_scaling=llama.rope_scaling(config),
        sliding_window=sliding_window(config),
        architectures=[MODEL],
    )


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Logical megalite tensors -> MistralForCausalLM's (Llama's names)."""
    check(config)
    return llama.to_hf(state, _llama_view(config))


def config_from_hf(hf) -> GPTConfig:
    """A ``transformers.MistralConfig`` -> the GPTConfig of the same model: Llama's, with
    ``window_size`` (sliding_window - 1, 0) when it has a window (and no attention dropout:
    windowed attention has none)."""
    base = llama.config_from_hf(hf)
    w = hf.sliding_window
    if w is None:
        return base
    if w < 2:  # megalite refuses window_size 0,0 (a token that sees only itself)
        raise ConversionError(f"Mistral sliding_window {w}: megalite's window needs 2 or more")
    return dataclasses.replace(base, window_size=(w - 1, 0), attention_dropout=0.0)


def from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """MistralForCausalLM's tensors -> logical megalite tensors."""
    return llama.from_hf(hf_state, _llama_view(config))
