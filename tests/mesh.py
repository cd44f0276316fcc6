"""The one helper that builds a test's mesh.

    ps = mesh(tp=2, pp=2)              # on every rank of the harness's world; DP is what is left
    ps = mesh(2, cp=2, ep=2, etp=1)    # context and expert axes by their short names
    ps = mesh(8, mode="2.5d", depth=2) # a tensor-parallel mode's grid inside each tensor group

The process groups of one layout (``initialize_model_parallel``, Megatron's default rank order
unless ``order`` says otherwise) on the gloo world ``tests/harness.py`` started, or a world of one
in a plain test. Groups a case made are destroyed by the harness after it; ``ps.destroy()`` frees
them earlier when a case builds several meshes.
"""

from __future__ import annotations

from megalite.core.parallel_state import ParallelState, initialize_model_parallel


def mesh(
    tp: int = 1,
    pp: int = 1,
    *,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    mode: str = "1d",
    depth: int = 1,
    **kwargs,
) -> ParallelState:
    """TP x CP x (E)P x DP x PP groups; ``kwargs`` (order, device, timeout) pass through."""
    return initialize_model_parallel(
        tp,
        pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        tensor_parallel_mode=mode,
        tensor_parallel_depth=depth,
        **kwargs,
    )
