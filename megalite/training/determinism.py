"""``--deterministic-mode``: the settings under which two GPU runs give the same bits, as
Megatron-LM makes them.

    with deterministic_mode(cfg.training.deterministic_mode):   # in pretrain, before any group
        ...

Inside, and restored on exit (``pretrain`` may run several times in one process):

- ``torch.use_deterministic_algorithms(True)``: cuDNN and the other kernels pick deterministic
  algorithms, and an operation that has none raises instead of running nondeterministically;
- the environment the libraries read when they start (so it is set before the first process
  group and the first cuBLAS handle): ``NCCL_ALGO=Ring`` (a fixed reduction order; a launcher's
  ``Ring``, ``CollnetDirect``, ``CollnetChain`` or ``^NVLS`` is kept), ``CUBLAS_WORKSPACE_CONFIG=
  :4096:8`` (or a launcher's ``:16:8``), ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (Transformer
  Engine's, for a process that also imports it). Another value set by the launcher is refused in
  one line: the run would not be deterministic.

megalite's own Triton kernels reduce without atomics. On CPU (gloo) every kernel megalite runs is
deterministic already; the mode changes no number there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping

import torch

from megalite.errors import ConfigError

ENV_DEFAULTS = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}
NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # accepted NCCL_ALGO tokens
ENV_ACCEPTED = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
}


def check_environment(env: MutableMapping[str, str]) -> None:
    """A launcher's value of each variable is a deterministic one, else one-line ConfigError."""
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            raise ConfigError(
                f"--deterministic-mode: NCCL_ALGO={algo!r} does not fix the reduction order; "
                f"unset it or use {', '.join(NCCL_ALGOS)}"
            )
    for name, accepted in ENV_ACCEPTED.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise ConfigError(
                f"--deterministic-mode: {name}={value!r} is not deterministic; unset it or use "
                f"{' or '.join(accepted)}"
            )


@contextlib.contextmanager
def deterministic_mode(
    enabled: bool, env: MutableMapping[str, str] | None = None
) -> Iterator[None]:
    """The module docstring's settings inside when ``enabled`` (else nothing); ``env``: default
    ``os.environ``."""
    if not enabled:
        yield
        return
    env = os.environ if env is None else env
    check_environment(env)
    added = [k for k in ENV_DEFAULTS if k not in env]
    for k in added:
        env[k] = ENV_DEFAULTS[k]
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
        for k in added:
            env.pop(k, None)
