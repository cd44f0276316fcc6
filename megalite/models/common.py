"""Helpers the model's modules share: initialisers keyed by parameter name, dropout RNG regions."""

from __future__ import annotations

import contextlib

from megalite.core.tensor_parallel.init import InitMethod, init_normal, init_scaled_normal
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.config import GPTConfig


def weight_init(config: GPTConfig, key: str, *, scaled: bool = False) -> InitMethod:
    """Megatron's init for the weight named ``key`` (its state-dict name with the GLOBAL layer
    number): ``N(0, std^2)``, or ``std / sqrt(2 * num_layers)`` for output projections
    (``scaled``)."""
    if scaled:
        return init_scaled_normal(
            config.init_method_std, config.num_layers, seed=config.seed, key=key
        )
    return init_normal(config.init_method_std, seed=config.seed, key=key)


def first_rows(init: InitMethod, rows: int) -> InitMethod:
    """Apply ``init`` to the first ``rows`` rows only (the real vocabulary; padding rows stay zero),
    drawing exactly the numbers ``init`` would draw for a ``[rows, ...]`` tensor."""

    def apply(weight) -> None:
        init(weight[:rows])

    return apply


def tp_rng_region(tracker: RNGStatesTracker | None, active: bool):
    """The context dropout on TP-sharded (or sequence-sharded) activations runs in: the tracker's
    tensor-parallel state, which differs across TP ranks and agrees across DP ranks."""
    if not active:
        return contextlib.nullcontext()
    if tracker is None:
        raise RuntimeError(
            "dropout on tensor/sequence-parallel activations needs an RNG tracker: build the model "
            "with rng_tracker=model_parallel_seed(seed, tp_rank=..., pp_rank=...), or set "
            "hidden_dropout and attention_dropout to 0"
        )
    return tracker.fork()
